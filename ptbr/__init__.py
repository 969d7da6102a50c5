"""ptbr: train Portuguese (PT-BR) language models reproducibly, without surprises."""

__version__ = "0.1.0"
