"""Rewrite a GGUF with one thing changed: the bad-input tests' way of making broken files."""
import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def rewrite_gguf(src, dst, drop_tensors=(), replace_tensors=None, drop_keys=(), set_keys=None):
    """Copy ``src`` to ``dst``; ``replace_tensors`` maps name -> (array, raw_dtype or None);
    ``set_keys`` maps key -> (value, GGUFValueType[, sub_type])."""
    r = GGUFReader(src)
    replace_tensors, set_keys = replace_tensors or {}, set_keys or {}
    arch = r.fields["general.architecture"].contents()
    if "general.architecture" in set_keys:
        arch = set_keys.pop("general.architecture")[0]
    w = GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if key in set_keys:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        value = field.contents()
        if isinstance(value, list) and not value:
            continue  # gguf-py cannot write an empty array (the fixture's merges)
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, spec in set_keys.items():
        w.add_key_value(key, spec[0], spec[1], sub_type=spec[2] if len(spec) > 2 else None)
    for t in r.tensors:
        if t.name in drop_tensors:
            continue
        if t.name in replace_tensors:
            arr, raw_dtype = replace_tensors[t.name]
            w.add_tensor(t.name, arr, raw_dtype=raw_dtype)
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
