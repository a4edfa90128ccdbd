"""The HSTU ranking model: embeddings, preprocessor, HSTU layers/block, postprocessor and head."""
