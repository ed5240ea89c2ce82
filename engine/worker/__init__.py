"""Every rank: the model runner, the rank's request state, the paged KV cache, static steps and CUDA graphs, the
speculation contract, KV sizing, telemetry and the worker loop."""
