"""Weight sources: Hugging Face safetensors folders, GGUF files, and random (dummy) weights.

Each source yields ``(Hugging Face tensor name, tensor)`` pairs that a model's ``load_weights``
consumes, so the models know one naming scheme only.
"""
