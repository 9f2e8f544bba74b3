"""The model side: weights loading, layers, paged attention and sampling."""
