"""(placeholder package: filled by a later issue; see README.md)"""
