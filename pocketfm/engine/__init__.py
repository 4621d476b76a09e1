"""The GPU engine: V4 decode as one captured CUDA graph over device-resident weights and state."""
