"""The shipped router, built: its training prompts, its labels' judge, its training and its card."""
