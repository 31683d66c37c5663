"""The Gradio demo: strategies side by side (``decodekit demo``)."""
