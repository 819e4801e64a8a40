"""Expert predictors: the interface and the training-free ones (base.py), the draft-model predictor
(draft.py), the one registry that builds them by name (registry.py) and their recall evaluation
(evaluate.py)."""
