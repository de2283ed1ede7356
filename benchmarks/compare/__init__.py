"""Train one config with several attention backends and compare loss curves, step time and kernel parity."""
