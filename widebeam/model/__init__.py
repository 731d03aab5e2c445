"""Model code: loading, layers, attention, runners."""
