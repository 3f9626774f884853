"""Learned drafters (EAGLE-style): training data, model, training and the drafter."""
