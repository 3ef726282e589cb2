"""Developer tools, apart from the runtime: the GPU bench (`qgemm bench`), the llama.cpp parity harness
(`python -m tools.parity`), the service's load generator (`qgemm loadtest`) and soak (`qgemm soak`)."""
