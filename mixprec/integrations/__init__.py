"""Framework integrations: PyTorch Lightning (:mod:`.lightning`) and Hugging Face
``transformers`` (:mod:`.huggingface`). Each imports its framework lazily; mixprec itself
depends on torch only."""
