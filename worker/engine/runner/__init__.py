"""Running a scheduler plan on the device: the model runner, CUDA graphs, host staging, the
sampler, pooling, the KV cache's sizing, and loading it all from a checkpoint."""
