"""C++/CUDA sources of the hstu extension, shipped as package data so the JIT build finds them."""
