// Native varlen-M with the activation epilogue, W1 in two parts (concatenated or separate: MoEConfig::w1_layout,
// w1_layout_sm90.cuh): the up-projection (step 4) of the glu activations, B = W1 read by the 4-mode descriptor in the
// interleaved order, b1 read in its two parts in the epilogue. Plain activations have no gate/up halves (the layout
// does not apply).
#include "cuda/gemm/instances/activation_of.cuh"
#include "cuda/gemm/w1_layout_sm90.cuh"

namespace sonicmoe::cuda::gemm::detail {

void SONICMOE_INSTANCE(native_activation_glu_w1_concat)(const NativeVarlenM& g, Activation act,
                                                        const __nv_bfloat16* bias, __nv_bfloat16* z,
                                                        __nv_bfloat16* a_out, W1BiasStrides bs) {
  // b1's part and expert strides; 0: the concatenated b1's (I, 2I)
  const std::int64_t part = bs.part ? bs.part : g.n / 2, expert = bs.expert ? bs.expert : g.n;
  activation_cfg_of<sm90::W1ConcatCfg<sm90::VarlenMMmaGatherCfgOf<InstanceElement>>, GluActivations>(
      "native_activation_glu_w1_concat", g, act, bias, z, a_out, part, expert);
}

}  // namespace sonicmoe::cuda::gemm::detail
