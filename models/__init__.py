"""GGUF model files: the store that opens them, the demo model, the fetch of the real one."""
