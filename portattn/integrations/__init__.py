"""Integrations of portattn with other libraries (each imports its library lazily).

- `portattn.integrations.transformers`: `register()` makes `attn_implementation="portattn"`
  available to Hugging Face transformers models.
"""
