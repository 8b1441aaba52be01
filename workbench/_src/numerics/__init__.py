"""Distributed vs single-device numerics: batch norm, loss scaling, differences."""
