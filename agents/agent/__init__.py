"""The gpushare node agent (no Django: it talks to the platform only through the broker)."""

__version__ = "0.1.0"
