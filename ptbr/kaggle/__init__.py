"""`ptbr kaggle`: a bundle for a Kaggle kernel (bundle.py), and pushing it, following it and
fetching its outputs through the Kaggle API (remote.py, client.py). The kernel script and the
metadata templates live in the checkout's top-level kaggle/ folder."""
