"""What the numbers mean: the diagnosis's rules, tolerances for cross-device tests, and the
candle write-up's claims checked."""
