"""Recipes for public interaction logs (MovieLens, KuaiRand) -> kunlun datasets."""
