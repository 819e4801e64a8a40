"""Talking to phones over adb, and a loopback stand-in phone for testing that with no phone."""
