"""Scripts launched under torchrun by the distributed tests (each prints one ``RESULT {json}`` line)."""
