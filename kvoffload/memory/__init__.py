"""The data path: shared-memory segments, the host pool, the slot header table, the block header
format, engine-side KV caches, CUDA host registration and slot copies."""
