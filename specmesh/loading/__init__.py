"""Model loading: models by alias, path, GGUF or hub id, the embedded pair, precisions, CPU linear kernels,
transformers compatibility, OpenMP settings. Imports neither the engine nor the server plumbing."""
