"""The Rec SDK's import paths, so scripts written for it run on shardrec. Names only: the logic
lives in shardrec.rank_runtime."""
