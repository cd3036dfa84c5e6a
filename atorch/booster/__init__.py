"""The Booster: Colossal-AI's training interface over atorch strategies."""
