"""FP8 matmuls for chosen ``nn.Linear`` layers (the ``fp8=`` option); see ``docs/fp8.md``."""
