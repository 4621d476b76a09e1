"""KV swap: the compressed KV history of the CSA layers in a host cold pool, the chunks the Memory
Indexer selects in GPU staging slots."""
