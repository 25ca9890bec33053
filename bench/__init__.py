"""Benchmarks that print ratios to a baseline measured in the same run (results/ keeps dated JSON)."""
