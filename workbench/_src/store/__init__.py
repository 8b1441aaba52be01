"""Reading the run store back: listing, loading, comparing and deleting runs."""
