"""Data: tokenizer training, .bin token datasets, and the bundled PT-BR sample."""

from pathlib import Path

SAMPLE_DIR = Path(__file__).parent / "sample"
