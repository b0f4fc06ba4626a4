"""Rec SDK import path; see mx_rec/__init__.py."""
