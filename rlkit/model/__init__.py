"""The model layer: loading a model, its tokenizer and processor, wrapping it for training
(`load.py`); what a recipe asks of its models, checked before launch (`checks.py`); vision-language
parts, attention for packed rows, kernels, GGUF files."""
