// The extension module: quantized linear layers (qlinear.cpp) and attention (attention.cpp).
#include <torch/extension.h>

void register_qlinear(pybind11::module& m);
void register_attention(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_qlinear(m);
  register_attention(m);
}
