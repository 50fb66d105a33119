"""Tests of the web page (``asiento serve``)."""
