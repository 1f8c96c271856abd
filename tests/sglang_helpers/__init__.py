"""Helpers of the SGLang tests: SGLang's install step, its torchvision stub, engine processes."""
