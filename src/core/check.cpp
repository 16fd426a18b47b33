#include "core/check.h"

#include "core/device_ops.h"

namespace sonicmoe::check {

namespace {
std::string dims_str(std::initializer_list<std::int64_t> dims) {
  std::string s = "[";
  int i = 0;
  for (auto d : dims) {
    s += i++ ? ", " : "";
    s += d < 0 ? std::string("*") : std::to_string(d);
  }
  return s + "]";
}
}  // namespace

std::string Arg::prefix() const { return std::string("sonicmoe::") + fn_ + ": argument '" + name_ + "'"; }

Arg& Arg::given() {
  SONICMOE_CHECK(v_.given(), prefix(), " is required but was not given");
  for (int d = 0; d < v_.ndim; ++d)  // shape is a public field: a view may carry sizes its constructor rejects
    SONICMOE_CHECK(v_.shape[d] >= 0, prefix(), " has a negative size ", v_.shape[d], " in dimension ", d,
                   " (shape ", v_.shape_str(), ")");
  SONICMOE_CHECK(v_.data != nullptr || v_.numel() == 0, prefix(), " has a null data pointer");
  // Every element must be addressable as its type: a view shifted by a byte would read torn values.
  const std::size_t elem = dtype_size(v_.dtype);
  SONICMOE_CHECK(reinterpret_cast<std::uintptr_t>(v_.data) % elem == 0, prefix(), " data pointer ", v_.data,
                 " is not aligned to its ", elem, "-byte ", dtype_name(v_.dtype), " elements");
  return *this;
}

Arg& Arg::dtype(DType expected) {
  SONICMOE_CHECK(v_.dtype == expected, prefix(), " has dtype ", dtype_name(v_.dtype), ", expected ",
                 dtype_name(expected));
  return *this;
}

Arg& Arg::float_dtype() {
  SONICMOE_CHECK(is_16bit_float(v_.dtype) || v_.dtype == DType::f32, prefix(), " has dtype ", dtype_name(v_.dtype),
                 ", expected bf16, f16 or f32");
  return *this;
}

Arg& Arg::ndim(int expected) {
  SONICMOE_CHECK(v_.ndim == expected, prefix(), " has ", v_.ndim, " dimensions ", v_.shape_str(), ", expected ",
                 expected);
  return *this;
}

Arg& Arg::shape(std::initializer_list<std::int64_t> expected, const char* desc) {
  bool ok = v_.ndim == static_cast<int>(expected.size());
  int d = 0;
  for (auto e : expected) {
    if (ok && e >= 0 && v_.shape[d] != e) ok = false;
    ++d;
  }
  SONICMOE_CHECK(ok, prefix(), " has shape ", v_.shape_str(), ", expected ", dims_str(expected), " (", desc, ")");
  return *this;
}

Arg& Arg::on(Device expected) {
  SONICMOE_CHECK(v_.device == expected, prefix(), " is on ", device_name(v_.device), ", expected ",
                 device_name(expected), " (the context's backend)");
  return *this;
}

Arg& Arg::contiguous() {
  if (!v_.is_contiguous()) {
    std::string strides = "[";
    for (int d = 0; d < v_.ndim; ++d) strides += (d ? ", " : "") + std::to_string(v_.stride[d]);
    throw Error(prefix() + " is not contiguous (shape " + v_.shape_str() + ", strides " + strides +
                "]); pass a contiguous tensor");
  }
  return *this;
}

Arg& Arg::aligned(std::size_t bytes) {
  SONICMOE_CHECK(reinterpret_cast<std::uintptr_t>(v_.data) % bytes == 0, prefix(), " data pointer ", v_.data,
                 " is not ", bytes, "-byte aligned");
  return *this;
}

Arg& Arg::values_in(std::int64_t lo, std::int64_t hi, const char* range_desc) {
  if (v_.device.is_cuda()) return *this;  // device contents are checked by the kernels' own guards
  const std::int32_t* p = v_.ptr<std::int32_t>();
  for (std::int64_t i = 0, n = v_.numel(); i < n; ++i)
    SONICMOE_CHECK(p[i] >= lo && p[i] < hi, prefix(), "[", i, "] = ", p[i], " is out of range, expected ",
                   range_desc, " = [", lo, ", ", hi, ")");
  return *this;
}

Arg& Arg::non_decreasing() {
  if (v_.device.is_cuda()) return *this;
  const std::int32_t* p = v_.ptr<std::int32_t>();
  for (std::int64_t i = 1, n = v_.numel(); i < n; ++i)
    SONICMOE_CHECK(p[i - 1] <= p[i], prefix(), " must be sorted (non-decreasing) but element ", i, " = ", p[i],
                   " follows ", p[i - 1]);
  return *this;
}

void routing_metadata(const char* fn, const Context& ctx, const RoutingMetadata& m, std::int64_t T, std::int64_t E,
                      bool values) {
  SONICMOE_CHECK(m.num_tokens == T && m.num_experts == E, "sonicmoe::", fn, ": argument 'meta' describes T=",
                 m.num_tokens, ", E=", m.num_experts, ", expected T=", T, ", E=", E);
  // Negative sizes would turn the shape checks below (and the stages' own, which take T and N from here) into
  // wildcards ("-1: any"): a stage would then run over nothing and leave its output unwritten.
  SONICMOE_CHECK(m.num_tokens >= 0 && m.num_experts >= 1 && m.num_pairs >= 0, "sonicmoe::", fn,
                 ": argument 'meta' has num_tokens = ", m.num_tokens, ", num_experts = ", m.num_experts,
                 ", num_pairs = ", m.num_pairs, ", expected T >= 0, E >= 1, N >= 0");
  const std::int64_t N = m.num_pairs;
  const auto ints = [&](const char* name, const Tensor& t, std::int64_t n, const char* desc) {
    Arg(fn, name, t.view()).given().dtype(DType::i32).on(ctx.device()).contiguous().shape({n}, desc);
  };
  ints("meta.counts", m.counts, E, "[E]");
  ints("meta.offsets", m.offsets, E + 1, "[E+1]");
  ints("meta.pair", m.pair, N, "[N]");
  ints("meta.gather", m.gather, N, "[N]");
  ints("meta.rev", m.rev, N, "[N]");
  ints("meta.token_offsets", m.token_offsets, T + 1, "[T+1]");
  if (m.demand.defined()) ints("meta.demand", m.demand, E, "[E]");
  if (m.dropped.defined()) ints("meta.dropped", m.dropped, 1, "[1]");
  if (values && !ctx.device().is_cuda()) routing_metadata_values(fn, m);
}

void routing_metadata_values(const char* fn, const RoutingMetadata& m) {
  // The reference stages index with these arrays directly: a value out of range would read or write out of bounds.
  const std::int64_t T = m.num_tokens, E = m.num_experts, N = m.num_pairs;
  const std::int32_t* counts = m.counts.ptr<const std::int32_t>();
  const std::int32_t* offsets = m.offsets.ptr<const std::int32_t>();
  const std::int32_t* pair = m.pair.ptr<const std::int32_t>();
  const std::int32_t* gather = m.gather.ptr<const std::int32_t>();
  const std::int32_t* rev = m.rev.ptr<const std::int32_t>();
  const std::int32_t* toff = m.token_offsets.ptr<const std::int32_t>();
  const auto bad = [&](const char* name, std::int64_t i, std::int64_t v, const std::string& expected) {
    throw Error(detail::concat("sonicmoe::", fn, ": argument 'meta.", name, "'[", i, "] = ", v, ", expected ",
                               expected, " (inconsistent routing metadata)"));
  };
  if (offsets[0] != 0) bad("offsets", 0, offsets[0], "0");
  for (std::int64_t e = 0; e < E; ++e) {
    if (counts[e] < 0) bad("counts", e, counts[e], ">= 0");
    if (static_cast<std::int64_t>(offsets[e + 1]) != static_cast<std::int64_t>(offsets[e]) + counts[e])
      bad("offsets", e + 1, offsets[e + 1], detail::concat("offsets[e] + counts[e] = ",
                                                           static_cast<std::int64_t>(offsets[e]) + counts[e]));
  }
  const std::int64_t rows = offsets[E];
  if (rows > N) bad("offsets", E, rows, detail::concat("<= N = ", N));
  // (token_offsets[0] > 0: a range of the layer's tokens, summed on its own by aggregate, as the binding's gather_sum
  // does for the expert-parallel layer; the indices stay within [0, N] either way)
  if (toff[0] < 0 || toff[0] > N) bad("token_offsets", 0, toff[0], detail::concat("in [0, N = ", N, "]"));
  for (std::int64_t t = 0; t < T; ++t)
    if (toff[t + 1] < toff[t] || toff[t + 1] > N)
      bad("token_offsets", t + 1, toff[t + 1], detail::concat("non-decreasing and <= N = ", N));
  for (std::int64_t r = 0; r < rows; ++r) {
    if (pair[r] < 0 || pair[r] >= N) bad("pair", r, pair[r], detail::concat("in [0, N = ", N, ")"));
    if (gather[r] < 0 || gather[r] >= T) bad("gather", r, gather[r], detail::concat("in [0, T = ", T, ")"));
  }
  // rev only addresses rows of [N, .] buffers (aggregate reads y[rev[p]]); callers may pass it with metadata whose
  // other arrays are placeholders (the binding's gather_sum: offsets all 0), so the bound is N, not offsets[E].
  for (std::int64_t p = 0; p < N; ++p)
    if (rev[p] < -1 || rev[p] >= N) bad("rev", p, rev[p], detail::concat("-1 (no row) or a row in [0, N = ", N, ")"));
}

void backend(const Context& ctx, const char* fn) {
  SONICMOE_CHECK(ctx.backend == Backend::cpu || ctx.backend == Backend::cuda, "sonicmoe::", fn, ": ctx.backend = ",
                 static_cast<int>(ctx.backend), " is not a Backend, expected cpu (0) or cuda (1)");
  if (ctx.backend != Backend::cuda) return;
  SONICMOE_CHECK(devops::cuda_compiled(), "sonicmoe::", fn,
                 ": Backend::cuda requested but sonicmoe was built without CUDA");
  int n = devops::cuda_device_count();
  SONICMOE_CHECK(ctx.device_index >= 0 && ctx.device_index < n, "sonicmoe::", fn, ": Backend::cuda on device ",
                 ctx.device_index, " but ", n, " CUDA device(s) are visible");
}

}  // namespace sonicmoe::check
