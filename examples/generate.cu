// generate built by nvcc: the CPU run of generate.cpp, then the same model generating on the GPU
// through a device stack.
#include "generate.cpp"
