"""The target service: the large model that prefills, verifies drafts losslessly and owns tokenization."""
