# hostpool.py is compiled from this (Cython 3, pure-Python mode): its classes stay Python
# classes (their attributes are set and patched as any object's), their methods compiled.
cimport cython
