// A decoding step's attention over a layer's entries read where they lie, on a CPU: one operator per layer.
//
// The storage is a layer's EntryStorage: flat tensors holding a segment per (row, KV head) from `starts`, each
// with its own length. Keys and values are each either coded (2, 3, 4, 5 or 8 bits per channel, packed as quantize.py
// packs them, with a scale and an offset per group of channels) or plain (the stored dtype). Per (row, KV head),
// each stored key is decoded into a buffer of one entry and dotted with the query heads of its group, the logits
// (scaled, capped, biased, -inf outside a sliding window) get a softmax with the step's own token (read exact), and
// each value is decoded and added times its probability; the tokens a residual window holds are read exact from it.
// Nothing of the decoded size is ever written.
#include <torch/library.h>
#include <torch/types.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <utility>
#include <type_traits>
#include <limits>
#include <vector>

namespace {

#if defined(__x86_64__) && defined(__GNUC__)
#define DECODEKIT_X86 1
#include <immintrin.h>
#define DECODEKIT_AVX2 __attribute__((target("avx2,fma,f16c")))
#else
#define DECODEKIT_X86 0
#define DECODEKIT_AVX2
#endif

// Each byte of 4-bit codes as its two codes in channel order (low half first), in float.
struct Nibbles {
  float pairs[256][2];
  Nibbles() {
    for (int byte = 0; byte < 256; ++byte) pairs[byte][0] = byte & 15, pairs[byte][1] = byte >> 4;
  }
};
// Each byte of fifth bits as what it adds to its eight channels (16 or 0): channel 8i + 2j in bit j, 8i + 2j + 1
// in bit 4 + j.
struct FifthBits {
  float adds[256][8];
  FifthBits() {
    for (int byte = 0; byte < 256; ++byte)
      for (int c = 0; c < 8; ++c) adds[byte][c] = ((byte >> ((c / 2) + 4 * (c % 2))) & 1) * 16.f;
  }
};
// Each byte of 2-bit codes as its four codes in channel order (channel 4i + j in bits 2j and 2j + 1), in float.
struct Pairs {
  float codes[256][4];
  Pairs() {
    for (int byte = 0; byte < 256; ++byte)
      for (int j = 0; j < 4; ++j) codes[byte][j] = (byte >> (2 * j)) & 3;
  }
};
const Nibbles kNibbles;
const FifthBits kFifthBits;
const Pairs kPairs;

// One part (keys or values) of the storage: where its codes or plain entries are and how to read them.
template <typename Scale>
struct Part {
  const uint8_t* codes = nullptr;  // coded: per entry `code_bytes` bytes
  const Scale* plain = nullptr;    // plain: per entry `head_dim` elements
  const Scale* scales = nullptr;   // coded: per entry `groups` scales and as many offsets
  const Scale* offsets = nullptr;
  int64_t code_bytes = 0;
  int64_t groups = 1;
  int64_t group_size = 0;
  int64_t bits = 16;  // 2, 3, 4, 5, 8, or 16 (plain)
};

// The codes of the entry at flat slot `slot` as floats in `out` [head_dim] (a plain entry: its values).
template <typename Scale>
inline void codes_of(const Part<Scale>& part, int64_t slot, int64_t head_dim, float* __restrict__ out) {
  if (part.bits == 16) {
    const Scale* entry = part.plain + slot * head_dim;
    for (int64_t c = 0; c < head_dim; ++c) out[c] = static_cast<float>(entry[c]);
    return;
  }
  const uint8_t* code = part.codes + slot * part.code_bytes;
  if (part.bits == 8) {
    for (int64_t c = 0; c < head_dim; ++c) out[c] = static_cast<float>(code[c]);
    return;
  }
  if (part.bits < 4) {  // four codes a byte, then at 3 bits the third bits eight a byte (channel 8i + j in bit j)
    for (int64_t i = 0; i < head_dim / 4; ++i)
      for (int j = 0; j < 4; ++j) out[4 * i + j] = kPairs.codes[code[i]][j];
    if (part.bits == 3) {
      const uint8_t* third = code + head_dim / 4;
      for (int64_t c = 0; c < head_dim; ++c) out[c] += ((third[c / 8] >> (c % 8)) & 1) * 4.f;
    }
    return;
  }
  for (int64_t i = 0; i < head_dim / 2; ++i) {
    out[2 * i] = kNibbles.pairs[code[i]][0];
    out[2 * i + 1] = kNibbles.pairs[code[i]][1];
  }
  if (part.bits == 5) {
    const uint8_t* fifth = code + head_dim / 2;
    for (int64_t i = 0; i < head_dim / 8; ++i) {
      const float* __restrict__ adds = kFifthBits.adds[fifth[i]];
      float* __restrict__ channels = out + 8 * i;
      for (int c = 0; c < 8; ++c) channels[c] += adds[c];
    }
  }
}

// The entry at flat slot `slot` decoded into `out` [head_dim]: each group's offset plus its codes times its scale.
template <typename Scale>
inline void decode(const Part<Scale>& part, int64_t slot, int64_t head_dim, float* __restrict__ out) {
  codes_of(part, slot, head_dim, out);
  if (part.bits == 16) return;
  const Scale* scale = part.scales + slot * part.groups;
  const Scale* offset = part.offsets + slot * part.groups;
  for (int64_t k = 0; k < part.groups; ++k) {
    const float s = static_cast<float>(scale[k]), o = static_cast<float>(offset[k]);
    float* __restrict__ channels = out + k * part.group_size;
    for (int64_t c = 0; c < part.group_size; ++c) channels[c] = o + channels[c] * s;
  }
}

#if DECODEKIT_X86
// A stored scale or offset as float: 16-bit floats converted by the CPU (F16C), bfloat16 by a shift.
DECODEKIT_AVX2 inline float to_float(c10::Half value) { return _cvtsh_ss(value.x); }
DECODEKIT_AVX2 inline float to_float(c10::BFloat16 value) {
  const uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, 4);
  return result;
}
DECODEKIT_AVX2 inline float to_float(float value) { return value; }
DECODEKIT_AVX2 inline float to_float(double value) { return static_cast<float>(value); }
#endif

#if DECODEKIT_X86
// `decode` with AVX2, eight channels at a time (coded parts whose groups hold a multiple of eight channels).
template <typename Scale>
DECODEKIT_AVX2 inline void decode_avx2(const Part<Scale>& part, int64_t slot, int64_t head_dim,
                                       float* __restrict__ out) {
  if (part.bits == 16) {
    const Scale* entry = part.plain + slot * head_dim;
    for (int64_t c = 0; c < head_dim; ++c) out[c] = to_float(entry[c]);
    return;
  }
  const uint8_t* code = part.codes + slot * part.code_bytes;
  const Scale* scale = part.scales + slot * part.groups;
  const Scale* offset = part.offsets + slot * part.groups;
  const __m128i low_half = _mm_set1_epi8(0x0F);
  const __m256i fifth_shift = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // channel 8i + c: its bit of byte i
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i pair_shift = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);  // channel 4i + j: bits 2j of byte i
  const __m256i bit_shift = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i three = _mm256_set1_epi32(3);
  for (int64_t k = 0; k < part.groups; ++k) {
    const __m256 s = _mm256_set1_ps(to_float(scale[k]));
    const __m256 o = _mm256_set1_ps(to_float(offset[k]));
    for (int64_t c = k * part.group_size; c < (k + 1) * part.group_size; c += 8) {
      __m256i ints;
      if (part.bits == 8) {
        ints = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code + c)));
      } else if (part.bits < 4) {
        uint16_t two;
        std::memcpy(&two, code + c / 4, 2);
        ints = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(two), pair_shift), three);
        if (part.bits == 3) {
          const __m256i third = _mm256_srlv_epi32(_mm256_set1_epi32(code[head_dim / 4 + c / 8]), bit_shift);
          ints = _mm256_or_si256(ints, _mm256_slli_epi32(_mm256_and_si256(third, one), 2));
        }
      } else {
        uint32_t four;
        std::memcpy(&four, code + c / 2, 4);
        const __m128i bytes = _mm_cvtsi32_si128(static_cast<int>(four));
        const __m128i low = _mm_and_si128(bytes, low_half);
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_half);
        ints = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(low, high));  // channel order: each byte's low half first
        if (part.bits == 5) {
          const __m256i fifth = _mm256_srlv_epi32(_mm256_set1_epi32(code[head_dim / 2 + c / 8]), fifth_shift);
          ints = _mm256_or_si256(ints, _mm256_slli_epi32(_mm256_and_si256(fifth, one), 4));
        }
      }
      _mm256_storeu_ps(out + c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), s, o));
    }
  }
}
#endif

// Whether `attend_unit_avx2` reads a part: entries of a multiple of eight channels, plain or coded in groups of a
// multiple of eight channels, on a CPU with AVX2, FMA and F16C.
template <typename Scale>
bool fits_avx2(const Part<Scale>& part, int64_t head_dim) {
#if DECODEKIT_X86
  static const bool supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                                __builtin_cpu_supports("f16c");
  return supported && head_dim % 8 == 0 && (part.bits == 16 || part.group_size % 8 == 0);
#else
  return false;
#endif
}

inline float dot(const float* __restrict__ a, const float* __restrict__ b, int64_t n) {
  float partial[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int k = 0; k < 8; ++k) partial[k] += a[c + k] * b[c + k];
  float sum = 0.f;
  for (; c < n; ++c) sum += a[c] * b[c];
  for (int k = 0; k < 8; ++k) sum += partial[k];
  return sum;
}

struct Step {
  const float* queries;     // [units * group, head_dim]
  const int64_t* starts;    // [units]
  const int64_t* lengths;   // [units], the step's own entry counted
  const float* own_keys;    // [units, head_dim]
  const float* own_values;  // [units, head_dim]
  const float* biases;      // flat, or null
  const int32_t* positions; // flat, or null (no window and no residual window)
  int64_t group, head_dim, slots;
  float scaling, softcap;   // softcap 0: none
  int64_t query_position, window;
  float* output;            // [units * group, head_dim]
  float* received;          // [units, slots]
  // The residual window (ring 0: none): the exact keys (as attention reads them) and values of the last `ring`
  // tokens, [units, ring, head_dim] in the scales' dtype, at slot `position % ring` where `ring_positions` holds
  // that position.
  const void* ring_keys = nullptr;
  const void* ring_values = nullptr;
  const int32_t* ring_positions = nullptr;
  int64_t ring = 0;
  // Smoothed keys: each unit's mean key (float32 [units, head_dim], as attention reads keys), added to every key
  // decoded from its codes; null where keys are not smoothed.
  const float* key_means = nullptr;
};

// A decoded key of unit `unit` given back its mean where keys are smoothed.
inline void add_key_mean(const Step& step, int64_t unit, float* __restrict__ entry) {
  if (step.key_means == nullptr) return;
  const float* __restrict__ mean = step.key_means + unit * step.head_dim;
#pragma omp simd
  for (int64_t c = 0; c < step.head_dim; ++c) entry[c] += mean[c];
}

// The exact entry the residual window holds for the token at flat slot `flat` of unit `unit`, copied into `out` as
// floats: true where it holds it (the entry is then not decoded).
template <typename Scale>
inline bool from_ring(const Step& step, const void* ring, int64_t unit, int64_t flat, float* __restrict__ out) {
  if (step.ring == 0) return false;
  const int32_t position = step.positions[flat];
  if (position < 0) return false;
  const int64_t index = position % step.ring;
  if (step.ring_positions[index] != position) return false;
  const Scale* exact = static_cast<const Scale*>(ring) + (unit * step.ring + index) * step.head_dim;
  for (int64_t c = 0; c < step.head_dim; ++c) out[c] = static_cast<float>(exact[c]);
  return true;
}

// Each of `rows` rows of `width` logits replaced by its softmax.
inline void softmax_rows(float* logits, int64_t rows, int64_t width) {
  for (int64_t g = 0; g < rows; ++g) {
    float* row = logits + g * width;
    float most = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < width; ++s) most = std::max(most, row[s]);
#pragma omp simd
    for (int64_t s = 0; s < width; ++s) row[s] = std::exp(row[s] - most);
    float sum = 0.f;
    for (int64_t s = 0; s < width; ++s) sum += row[s];
    const float inverse = 1.f / sum;
    for (int64_t s = 0; s < width; ++s) row[s] *= inverse;
  }
}

#if DECODEKIT_X86
// e^x of eight floats (Cephes' polynomial after x = n ln 2 + r, within two units in the last place of std::exp); 0
// below -87 (a logit hidden by -inf, or a weight under float's normal range).
DECODEKIT_AVX2 inline __m256 exp_avx2(__m256 x) {
  const __m256 kept = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(_mm256_mul_ps(y, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(power)), kept);
}

// `softmax_rows` with AVX2: the maximum, e^(logit - maximum) and its sum eight logits at a time.
DECODEKIT_AVX2 inline void softmax_rows_avx2(float* logits, int64_t rows, int64_t width) {
  for (int64_t g = 0; g < rows; ++g) {
    float* row = logits + g * width;
    float most = -std::numeric_limits<float>::infinity();
    for (int64_t s = 0; s < width; ++s) most = std::max(most, row[s]);
    const __m256 shift = _mm256_set1_ps(most);
    __m256 sums = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= width; s += 8) {
      const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + s), shift));
      _mm256_storeu_ps(row + s, e);
      sums = _mm256_add_ps(sums, e);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, sums);
    float sum = 0.f;
    for (float lane : lanes) sum += lane;
    for (; s < width; ++s) sum += (row[s] = std::exp(row[s] - most));
    const float inverse = 1.f / sum;
    for (int64_t t = 0; t < width; ++t) row[t] *= inverse;
  }
}
#endif

// The step's own token's logits (read exact) put after a (row, KV head)'s `count` stored logits, each query head's
// softmax taken (with AVX2 where `vectorized`), and each slot's probability summed over the query heads written to
// `received`; returns that row.
inline float* with_own_token(const Step& step, const float* queries, int64_t unit, int64_t count,
                             std::vector<float>& logits, bool vectorized = false) {
  const int64_t group = step.group, head_dim = step.head_dim, width = count + 1;
  for (int64_t g = 0; g < group; ++g) {
    float value = dot(queries + g * head_dim, step.own_keys + unit * head_dim, head_dim) * step.scaling;
    if (step.softcap > 0) value = step.softcap * std::tanh(value / step.softcap);
    logits[g * width + count] = value;
  }
#if DECODEKIT_X86
  if (vectorized)
    softmax_rows_avx2(logits.data(), group, width);
  else
    softmax_rows(logits.data(), group, width);
#else
  softmax_rows(logits.data(), group, width);
#endif
  float* taken = step.received + unit * step.slots;
  for (int64_t s = 0; s < step.slots; ++s) taken[s] = 0.f;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t s = 0; s < width; ++s) taken[s] += logits[g * width + s];
  return taken;
}

// Each query head's output: the stored values weighed (`total`, [group, head_dim]) plus its own value's share.
inline void write_output(const Step& step, int64_t unit, int64_t count, const std::vector<float>& logits,
                         const float* total) {
  const int64_t group = step.group, head_dim = step.head_dim, width = count + 1;
  const float* own_value = step.own_values + unit * head_dim;
  for (int64_t g = 0; g < group; ++g) {
    const float weight = logits[g * width + count];
    float* out = step.output + (unit * group + g) * head_dim;
    for (int64_t c = 0; c < head_dim; ++c) out[c] = total[g * head_dim + c] + weight * own_value[c];
  }
}

// One (row, KV head): its logits, softmax, received probabilities and output.
template <typename Scale>
void attend_unit(const Step& step, const Part<Scale>& keys, const Part<Scale>& values, int64_t unit,
                 std::vector<float>& logits, std::vector<float>& buffers) {
  const int64_t group = step.group, head_dim = step.head_dim;
  const int64_t start = step.starts[unit];
  const int64_t count = step.lengths[unit] - 1;  // entries stored before the step; the step's own at `count`
  const int64_t width = count + 1;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const float* queries = step.queries + unit * group * head_dim;
  buffers.assign(head_dim + group * head_dim, 0.f);
  float* entry = buffers.data();
  float* total = entry + head_dim;  // [group, head_dim]: the values weighed
  logits.assign(group * width, minus_inf);
  for (int64_t slot = 0; slot < count; ++slot) {
    const int64_t flat = start + slot;
    if (step.window > 0 && step.query_position - step.positions[flat] >= step.window) continue;
    if (!from_ring<Scale>(step, step.ring_keys, unit, flat, entry)) {
      decode(keys, flat, head_dim, entry);
      add_key_mean(step, unit, entry);
    }
    const float bias = step.biases != nullptr ? step.biases[flat] : 0.f;
    for (int64_t g = 0; g < group; ++g) {
      float value = dot(queries + g * head_dim, entry, head_dim) * step.scaling;
      if (step.softcap > 0) value = step.softcap * std::tanh(value / step.softcap);
      logits[g * width + slot] = value + bias;
    }
  }
  float* taken = with_own_token(step, queries, unit, count, logits);
  for (int64_t slot = 0; slot < count; ++slot) {
    if (taken[slot] == 0.f) continue;  // (outside the window, or no weight left at all)
    if (!from_ring<Scale>(step, step.ring_values, unit, start + slot, entry)) decode(values, start + slot, head_dim, entry);
    for (int64_t g = 0; g < group; ++g) {
      const float weight = logits[g * width + slot];
      float* __restrict__ out = total + g * head_dim;
      const float* __restrict__ decoded = entry;
      for (int64_t c = 0; c < head_dim; ++c) out[c] += weight * decoded[c];
    }
  }
  write_output(step, unit, count, logits, total);
}

#if DECODEKIT_X86
// The sum of each of eight vectors, as one vector.
DECODEKIT_AVX2 inline __m256 sums_of_eight(const __m256* v) {
  const __m256 a = _mm256_hadd_ps(v[0], v[1]), b = _mm256_hadd_ps(v[2], v[3]);
  const __m256 c = _mm256_hadd_ps(v[4], v[5]), d = _mm256_hadd_ps(v[6], v[7]);
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  // ab: [0 1 2 3 | 0 1 2 3] halves of sums 0-3; cd likewise for 4-7
  const __m256 low = _mm256_permute2f128_ps(ab, cd, 0x20), high = _mm256_permute2f128_ps(ab, cd, 0x31);
  return _mm256_add_ps(low, high);
}

// `out` ([kChunks * 8] floats) plus the `n` entries of `block` (rows of `stride` floats, `out`'s channels of each)
// times their `weights`, held in registers.
template <int kChunks>
DECODEKIT_AVX2 inline void add_weighed(float* out, const float* weights, const float* block, int64_t stride,
                                       int64_t n) {
  __m256 sum[kChunks];
  for (int k = 0; k < kChunks; ++k) sum[k] = _mm256_loadu_ps(out + 8 * k);
  for (int64_t j = 0; j < n; ++j) {
    const __m256 w = _mm256_set1_ps(weights[j]);
    const float* entry = block + j * stride;
    for (int k = 0; k < kChunks; ++k) sum[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(entry + 8 * k), sum[k]);
  }
  for (int k = 0; k < kChunks; ++k) _mm256_storeu_ps(out + 8 * k, sum[k]);
}

// `attend_unit` with AVX2, eight slots at a time: their keys decoded into a block, each query head's eight logits
// from one pass over the block; their values decoded into a block and added into each query head's output held in
// registers, 64 channels at a time (then eight at a time for the rest).
template <typename Scale>
DECODEKIT_AVX2 void attend_unit_avx2(const Step& step, const Part<Scale>& keys, const Part<Scale>& values,
                                     int64_t unit, std::vector<float>& logits, std::vector<float>& buffers) {
  constexpr int kBlock = 8;
  const int64_t group = step.group, head_dim = step.head_dim;
  const int64_t start = step.starts[unit];
  const int64_t count = step.lengths[unit] - 1;  // entries stored before the step; the step's own at `count`
  const int64_t width = count + 1;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const float* queries = step.queries + unit * group * head_dim;
  buffers.assign(kBlock * head_dim + group * head_dim, 0.f);
  float* block = buffers.data();
  float* total = block + kBlock * head_dim;  // [group, head_dim]: the values weighed
  logits.assign(group * width, minus_inf);
  for (int64_t first = 0; first < count; first += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, count - first);
    for (int64_t j = 0; j < n; ++j)
      if (!from_ring<Scale>(step, step.ring_keys, unit, start + first + j, block + j * head_dim)) {
        decode_avx2(keys, start + first + j, head_dim, block + j * head_dim);
        add_key_mean(step, unit, block + j * head_dim);
      }
    for (int64_t g = 0; g < group; ++g) {
      const float* query = queries + g * head_dim;
      __m256 partial[kBlock];
      for (int j = 0; j < kBlock; ++j) partial[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < head_dim; c += 8) {
        const __m256 q = _mm256_loadu_ps(query + c);
        for (int j = 0; j < kBlock; ++j)
          partial[j] = _mm256_fmadd_ps(q, _mm256_loadu_ps(block + j * head_dim + c), partial[j]);
      }
      alignas(32) float sums[kBlock];
      _mm256_store_ps(sums, sums_of_eight(partial));
      for (int64_t j = 0; j < n; ++j) {
        const int64_t flat = start + first + j;
        if (step.window > 0 && step.query_position - step.positions[flat] >= step.window) continue;
        float value = sums[j] * step.scaling;
        if (step.softcap > 0) value = step.softcap * std::tanh(value / step.softcap);
        logits[g * width + first + j] = value + (step.biases != nullptr ? step.biases[flat] : 0.f);
      }
    }
  }
  float* taken = with_own_token(step, queries, unit, count, logits, true);
  for (int64_t first = 0; first < count; first += kBlock) {
    const int64_t n = std::min<int64_t>(kBlock, count - first);
    for (int64_t j = 0; j < n; ++j)
      if (!from_ring<Scale>(step, step.ring_values, unit, start + first + j, block + j * head_dim))
        decode_avx2(values, start + first + j, head_dim, block + j * head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* weights = logits.data() + g * width + first;
      for (int64_t c0 = 0; c0 < head_dim; c0 += 64) {
        float* out = total + g * head_dim + c0;
        if (head_dim - c0 >= 64) {
          add_weighed<8>(out, weights, block + c0, head_dim, n);
        } else {
          for (int64_t c = c0; c < head_dim; c += 8) add_weighed<1>(total + g * head_dim + c, weights, block + c,
                                                                   head_dim, n);
        }
      }
    }
  }
  write_output(step, unit, count, logits, total);
}
#endif

template <typename Scale>
Part<Scale> part_of(const torch::Tensor& codes, const torch::Tensor& scales, const torch::Tensor& offsets,
                    int64_t bits, int64_t group_size) {
  Part<Scale> part;
  part.bits = bits;
  part.group_size = group_size;
  if (bits == 16) {
    part.plain = codes.data_ptr<Scale>();
    return part;
  }
  part.codes = codes.data_ptr<uint8_t>();
  part.code_bytes = codes.size(-1);
  part.scales = scales.data_ptr<Scale>();
  part.offsets = offsets.data_ptr<Scale>();
  part.groups = scales.size(-1);
  return part;
}

}  // namespace

// query: float32 [batch, kv_heads * group, 1, head_dim]; own_keys, own_values: float32 [batch, kv_heads, 1,
// head_dim]; starts, lengths: int64 [batch, kv_heads] (lengths counting the step's own entry, stored last); all
// contiguous. Per part, `bits` 16 reads `codes` as plain entries of the scales' dtype. Returns the output, float32
// [batch, 1, heads, head_dim], and each slot's probability summed over its group's query heads, float32 [batch,
// kv_heads, slots].
std::tuple<torch::Tensor, torch::Tensor> step_attention(
    const torch::Tensor& query, const torch::Tensor& key_codes, const torch::Tensor& key_scales,
    const torch::Tensor& key_offsets, int64_t key_bits, const torch::Tensor& value_codes,
    const torch::Tensor& value_scales, const torch::Tensor& value_offsets, int64_t value_bits, int64_t group_size,
    const torch::Tensor& starts, const torch::Tensor& lengths, const torch::Tensor& own_keys,
    const torch::Tensor& own_values, const c10::optional<torch::Tensor>& biases,
    const c10::optional<torch::Tensor>& positions, int64_t slots, double scaling,
    double softcap, int64_t query_position, int64_t window, const c10::optional<torch::Tensor>& ring_keys,
    const c10::optional<torch::Tensor>& ring_values, const c10::optional<torch::Tensor>& ring_positions,
    const c10::optional<torch::Tensor>& key_means) {
  const int64_t batch = starts.size(0), kv_heads = starts.size(1), head_dim = query.size(-1);
  const int64_t group = query.size(1) / kv_heads;
  TORCH_CHECK(query.is_contiguous() && query.scalar_type() == torch::kFloat32 && query.numel() == batch * kv_heads *
              group * head_dim, "step_attention: query must be contiguous float32 [batch, heads, 1, head_dim]");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64,
              "step_attention: starts and lengths must be int64");
  TORCH_CHECK(own_keys.is_contiguous() && own_values.is_contiguous() && own_keys.scalar_type() == torch::kFloat32 &&
              own_values.scalar_type() == torch::kFloat32, "step_attention: own keys and values: contiguous float32");
  auto output = torch::empty({batch, 1, kv_heads * group, head_dim}, query.options());
  auto received = torch::empty({batch, kv_heads, slots}, query.options());
  Step step{query.data_ptr<float>(), starts.data_ptr<int64_t>(), lengths.data_ptr<int64_t>(),
            own_keys.data_ptr<float>(), own_values.data_ptr<float>(),
            biases.has_value() ? biases->data_ptr<float>() : nullptr,
            positions.has_value() ? positions->data_ptr<int32_t>() : nullptr, group, head_dim, slots,
            static_cast<float>(scaling), static_cast<float>(softcap), query_position, window,
            output.data_ptr<float>(), received.data_ptr<float>()};
  const torch::Tensor& typed = key_bits == 16 ? key_codes : key_scales;
  if (ring_positions.has_value()) {
    TORCH_CHECK(ring_keys.has_value() && ring_values.has_value() && positions.has_value(),
                "step_attention: a residual window needs its keys, values and the entries' positions");
    const int64_t ring = ring_positions->numel();
    for (const auto* exact : {&*ring_keys, &*ring_values})
      TORCH_CHECK(exact->is_contiguous() && exact->numel() == batch * kv_heads * ring * head_dim &&
                  exact->scalar_type() == typed.scalar_type(),
                  "step_attention: the residual window's entries: contiguous [batch, heads, ring, head_dim] in the "
                  "scales' dtype");
    TORCH_CHECK(ring_positions->scalar_type() == torch::kInt32 && ring_positions->is_contiguous(),
                "step_attention: the residual window's positions: contiguous int32");
    step.ring = ring;
    step.ring_keys = ring_keys->data_ptr();
    step.ring_values = ring_values->data_ptr();
    step.ring_positions = ring_positions->data_ptr<int32_t>();
  }
  if (key_means.has_value()) {
    TORCH_CHECK(key_means->is_contiguous() && key_means->scalar_type() == torch::kFloat32 &&
                key_means->numel() == batch * kv_heads * head_dim,
                "step_attention: the mean keys: contiguous float32 [batch, heads, 1, head_dim]");
    step.key_means = key_means->data_ptr<float>();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, typed.scalar_type(), "step_attention", [&] {
    const auto keys = part_of<scalar_t>(key_codes, key_scales, key_offsets, key_bits, group_size);
    const auto values = part_of<scalar_t>(value_codes, value_scales, value_offsets, value_bits, group_size);
    at::parallel_for(0, batch * kv_heads, 1, [&](int64_t first, int64_t last) {
      std::vector<float> logits, buffers;
      for (int64_t unit = first; unit < last; ++unit) {
#if DECODEKIT_X86
        if (fits_avx2(keys, head_dim) && fits_avx2(values, head_dim)) {
          attend_unit_avx2<scalar_t>(step, keys, values, unit, logits, buffers);
          continue;
        }
#endif
        attend_unit<scalar_t>(step, keys, values, unit, logits, buffers);
      }
    });
  });
  return std::make_tuple(output, received);
}

namespace {

// `value` converted to Scale (rounding to nearest even), then moved one step toward +inf (`up`) or -inf where the
// rounding moved it the other way: what quantize.py's `_rounded` does.
template <typename Scale>
Scale rounded(float value, bool up) {
  Scale result = static_cast<Scale>(value);
  const float back = static_cast<float>(result);
  if (std::isnan(value) || (up ? back >= value : back <= value)) return result;
  if constexpr (std::is_same_v<Scale, float> || std::is_same_v<Scale, double>) {
    return static_cast<Scale>(std::nextafter(static_cast<float>(result), up ? INFINITY : -INFINITY));
  } else {
    uint16_t bits = result.x;
    const bool negative = bits & 0x8000;
    if ((bits & 0x7FFF) == 0) bits = up ? 0x0001 : 0x8001;  // (zero: the smallest number of the sign it moves to)
    else if (negative == up) bits -= 1;                     // toward zero
    else bits += 1;                                         // away from zero
    Scale moved;
    moved.x = bits;
    return moved;
  }
}

// Whether entries are coded in `bits`, and the channels one packed byte's codes span (a head_dim is a multiple).
inline bool packs(int64_t bits) { return bits == 2 || bits == 3 || bits == 4 || bits == 5 || bits == 8; }
inline int64_t packed_channels(int64_t bits) { return bits == 4 ? 2 : bits == 2 ? 4 : bits == 8 ? 1 : 8; }

template <typename Scale>
void encode_rows(const float* values, int64_t rows, int64_t head_dim, int64_t bits, int64_t group_size,
                 uint8_t* codes, Scale* scales, Scale* offsets) {
  const int64_t groups = head_dim / group_size, code_bytes = head_dim * bits / 8;
  const float largest = static_cast<float>((1 << bits) - 1);
  at::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
    std::vector<uint8_t> code(head_dim);
    for (int64_t row = first; row < last; ++row) {
      const float* entry = values + row * head_dim;
      for (int64_t k = 0; k < groups; ++k) {
        const float* channels = entry + k * group_size;
        float low = channels[0], high = channels[0];
        for (int64_t c = 1; c < group_size; ++c) low = std::min(low, channels[c]), high = std::max(high, channels[c]);
        const Scale offset = rounded<Scale>(low, false);
        const float base = static_cast<float>(offset);
        const Scale scale = rounded<Scale>((high - base) / largest, true);
        const float step = std::max(static_cast<float>(scale), std::numeric_limits<float>::min());
        for (int64_t c = 0; c < group_size; ++c) {
          const float rounded_code = std::nearbyint((channels[c] - base) / step);
          code[k * group_size + c] = static_cast<uint8_t>(std::min(std::max(rounded_code, 0.f), largest));
        }
        scales[row * groups + k] = scale;
        offsets[row * groups + k] = offset;
      }
      uint8_t* packed = codes + row * code_bytes;
      if (bits == 8) {
        std::memcpy(packed, code.data(), head_dim);
        continue;
      }
      if (bits < 4) {
        for (int64_t i = 0; i < head_dim / 4; ++i) {
          uint8_t four = 0;
          for (int j = 0; j < 4; ++j) four |= (code[4 * i + j] & 3) << (2 * j);
          packed[i] = four;
        }
        if (bits == 3) {
          for (int64_t i = 0; i < head_dim / 8; ++i) {
            uint8_t third = 0;
            for (int j = 0; j < 8; ++j) third |= ((code[8 * i + j] >> 2) & 1) << j;
            packed[head_dim / 4 + i] = third;
          }
        }
        continue;
      }
      for (int64_t i = 0; i < head_dim / 2; ++i) packed[i] = (code[2 * i] & 15) | ((code[2 * i + 1] & 15) << 4);
      if (bits == 5) {
        for (int64_t i = 0; i < head_dim / 8; ++i) {
          uint8_t fifth = 0;
          for (int j = 0; j < 4; ++j)
            fifth |= ((code[8 * i + 2 * j] >> 4) << j) | ((code[8 * i + 2 * j + 1] >> 4) << (4 + j));
          packed[head_dim / 2 + i] = fifth;
        }
      }
    }
  });
}

}  // namespace

// values: float32 [..., head_dim], contiguous (keys rotated already). Returns the codes (uint8 [..., head_dim * bits
// / 8]) and the scales and offsets ([..., head_dim / group_size], in `dtype`), equal to quantize.py's
// `Quantizer._encode_float`.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> encode_entries(const torch::Tensor& values, int64_t bits,
                                                                        int64_t group_size, at::ScalarType dtype) {
  TORCH_CHECK(values.is_contiguous() && values.scalar_type() == torch::kFloat32, "encode_entries: contiguous float32");
  TORCH_CHECK(packs(bits), "encode_entries: bits 2, 3, 4, 5 or 8");
  const int64_t head_dim = values.size(-1);
  TORCH_CHECK(head_dim % group_size == 0 && head_dim % packed_channels(bits) == 0,
              "encode_entries: the groups must divide the channels");
  const int64_t rows = head_dim == 0 ? 0 : values.numel() / head_dim;
  auto leading = values.sizes().vec();
  leading.pop_back();
  auto with_last = [&](int64_t last) {
    auto shape = leading;
    shape.push_back(last);
    return shape;
  };
  auto codes = torch::empty(with_last(head_dim * bits / 8), values.options().dtype(torch::kUInt8));
  auto scales = torch::empty(with_last(head_dim / group_size), values.options().dtype(dtype));
  auto offsets = torch::empty_like(scales);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "encode_entries", [&] {
    encode_rows<scalar_t>(values.data_ptr<float>(), rows, head_dim, bits, group_size, codes.data_ptr<uint8_t>(),
                          scales.data_ptr<scalar_t>(), offsets.data_ptr<scalar_t>());
  });
  return std::make_tuple(codes, scales, offsets);
}

namespace {

// Bytes of one row (first index) of `tensor`, and its data as bytes; the tensor must be contiguous.
std::pair<int64_t, uint8_t*> rows_of(const torch::Tensor& tensor) {
  TORCH_CHECK(tensor.is_contiguous(), "storage rows: a field's tensor must be contiguous");
  const int64_t rows = tensor.size(0);
  return {rows == 0 ? 0 : tensor.numel() / rows * tensor.element_size(),
          static_cast<uint8_t*>(tensor.data_ptr())};
}

// In each of `tensors`, copy the rows `from[i]` to the rows `to[i]` (i < n), all read before any is written.
void copy_held_rows(const std::vector<torch::Tensor>& tensors, const int64_t* from, const int64_t* to, int64_t n,
                    const char* op) {
  std::vector<uint8_t> held;
  for (const auto& tensor : tensors) {
    const auto [row_bytes, data] = rows_of(tensor);
    const int64_t rows = tensor.size(0);
    held.resize(n * row_bytes);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(from[i] >= 0 && from[i] < rows && to[i] >= 0 && to[i] < rows, op, ": a row out of range");
      std::memcpy(held.data() + i * row_bytes, data + from[i] * row_bytes, row_bytes);
    }
    for (int64_t i = 0; i < n; ++i) std::memcpy(data + to[i] * row_bytes, held.data() + i * row_bytes, row_bytes);
  }
}

// In each of `tensors`, write the rows of the matching tensor of `values` (n rows, the tensor's dtype and row size)
// at the rows `at[i]` (i < n).
void write_rows_at(const std::vector<torch::Tensor>& tensors, const std::vector<torch::Tensor>& values,
                   const int64_t* at, int64_t n, const char* op) {
  TORCH_CHECK(tensors.size() == values.size(), op, ": one values tensor per tensor");
  for (size_t k = 0; k < tensors.size(); ++k) {
    const auto [row_bytes, data] = rows_of(tensors[k]);
    const auto& written = values[k];
    TORCH_CHECK(written.is_contiguous() && written.scalar_type() == tensors[k].scalar_type() &&
                written.numel() * written.element_size() == n * row_bytes, op, ": values of the rows' shape");
    const auto* from = static_cast<const uint8_t*>(written.data_ptr());
    const int64_t rows = tensors[k].size(0);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(at[i] >= 0 && at[i] < rows, op, ": a row out of range");
      std::memcpy(data + at[i] * row_bytes, from + i * row_bytes, row_bytes);
    }
  }
}

}  // namespace

// For each tensor of `tensors` (a storage's fields, each [slots, ...]), copy the rows at `source` to the rows at
// `target` (int64 [n] each), all read before any is written (what index_select then index_copy_ of every field does).
void copy_rows(const std::vector<torch::Tensor>& tensors, const torch::Tensor& source, const torch::Tensor& target) {
  TORCH_CHECK(source.scalar_type() == torch::kInt64 && target.scalar_type() == torch::kInt64 &&
              source.numel() == target.numel() && source.is_contiguous() && target.is_contiguous(),
              "copy_rows: source and target must be contiguous int64 of one size");
  copy_held_rows(tensors, source.data_ptr<int64_t>(), target.data_ptr<int64_t>(), source.numel(), "copy_rows");
}

// For each tensor of `tensors` (a storage's fields), within each segment (from `starts`, int64 [batch, heads]), copy
// the rows at slots `sources` to the slots `targets` (int64 [batch, heads, n] each), only where `lanes` (bool, the
// same shape) is true when given, all read before any is written.
void move_in_segments(const std::vector<torch::Tensor>& tensors, const torch::Tensor& starts,
                      const torch::Tensor& sources, const torch::Tensor& targets,
                      const c10::optional<torch::Tensor>& lanes) {
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && sources.scalar_type() == torch::kInt64 &&
              targets.scalar_type() == torch::kInt64 && starts.is_contiguous() && sources.is_contiguous() &&
              targets.is_contiguous() && sources.sizes() == targets.sizes() && sources.dim() == 3 &&
              sources.size(0) * sources.size(1) == starts.numel(),
              "move_in_segments: int64 starts [batch, heads], sources and targets [batch, heads, n]");
  const bool* live = nullptr;
  if (lanes.has_value()) {
    TORCH_CHECK(lanes->scalar_type() == torch::kBool && lanes->is_contiguous() && lanes->sizes() == sources.sizes(),
                "move_in_segments: lanes, bool of the sources' shape");
    live = lanes->data_ptr<bool>();
  }
  const int64_t n = sources.size(2), units = starts.numel();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* from = sources.data_ptr<int64_t>();
  const int64_t* to = targets.data_ptr<int64_t>();
  std::vector<int64_t> source_rows, target_rows;
  for (int64_t unit = 0; unit < units; ++unit)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t k = unit * n + i;
      if (live != nullptr && !live[k]) continue;
      source_rows.push_back(start[unit] + from[k]);
      target_rows.push_back(start[unit] + to[k]);
    }
  copy_held_rows(tensors, source_rows.data(), target_rows.data(), static_cast<int64_t>(source_rows.size()),
                 "move_in_segments");
}

// For each tensor of `tensors`, write the rows of the matching tensor of `values` ([n, ...], the tensor's dtype and
// row size) at the rows `index` (int64 [n]): what index_copy_ of every field does.
void write_rows(const std::vector<torch::Tensor>& tensors, const torch::Tensor& index,
                const std::vector<torch::Tensor>& values) {
  TORCH_CHECK(index.scalar_type() == torch::kInt64 && index.is_contiguous(), "write_rows: contiguous int64 index");
  write_rows_at(tensors, values, index.data_ptr<int64_t>(), index.numel(), "write_rows");
}

// For each tensor of `tensors` (a storage's fields), write the matching tensor of `values` ([batch, heads, count,
// ...] rows in that order, the tensor's dtype) after each segment's entries: at the slots start + length + i (from
// `starts` and `lengths`, int64 [batch, heads]); and zero those slots of each tensor of `zeroed`.
void append_rows(const std::vector<torch::Tensor>& tensors, const std::vector<torch::Tensor>& values,
                 const std::vector<torch::Tensor>& zeroed, const torch::Tensor& starts, const torch::Tensor& lengths,
                 int64_t count) {
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64 &&
              starts.is_contiguous() && lengths.is_contiguous() && starts.numel() == lengths.numel(),
              "append_rows: int64 starts and lengths [batch, heads]");
  const int64_t units = starts.numel();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  std::vector<int64_t> slots;  // (row, head, i) order, as the values' rows
  for (int64_t unit = 0; unit < units; ++unit)
    for (int64_t i = 0; i < count; ++i) slots.push_back(start[unit] + length[unit] + i);
  const int64_t n = static_cast<int64_t>(slots.size());
  write_rows_at(tensors, values, slots.data(), n, "append_rows");
  for (const auto& tensor : zeroed) {
    const auto [row_bytes, data] = rows_of(tensor);
    const int64_t rows = tensor.size(0);
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(slots[i] >= 0 && slots[i] < rows, "append_rows: a row out of range");
      std::memset(data + slots[i] * row_bytes, 0, row_bytes);
    }
  }
}

// One decoding step's entry coded after each segment's entries: for each part k, `rows[k]` (float32 [batch, heads,
// 1, head_dim], contiguous; keys rotated already) coded in `bits[k]` bits in groups of `group_size` into the flat
// tensors `coded[3k]` (codes), `coded[3k + 1]` (scales) and `coded[3k + 2]` (offsets) at the slot `starts + lengths`
// (int64 [batch, heads]; each below its segment's `capacities`) of each segment, as encode_entries codes it; `positions` (int32) set to `position` there,
// each tensor of `written` given the matching row of `values` ([batch, heads, 1, ...], its dtype) there, and those
// slots of each tensor of `zeroed` zeroed.
void append_coded(const std::vector<torch::Tensor>& coded, const std::vector<torch::Tensor>& rows,
                  const std::vector<int64_t>& bits, int64_t group_size, const torch::Tensor& positions,
                  int64_t position, const std::vector<torch::Tensor>& written, const std::vector<torch::Tensor>& values,
                  const std::vector<torch::Tensor>& zeroed, const torch::Tensor& starts, const torch::Tensor& lengths,
                  const torch::Tensor& capacities) {
  TORCH_CHECK(coded.size() == 3 * rows.size() && bits.size() == rows.size(),
              "append_coded: codes, scales and offsets for each part, one width each");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64 &&
              starts.is_contiguous() && lengths.is_contiguous() && starts.numel() == lengths.numel(),
              "append_coded: int64 starts and lengths [batch, heads]");
  TORCH_CHECK(capacities.scalar_type() == torch::kInt64 && capacities.is_contiguous() &&
              capacities.numel() == starts.numel(), "append_coded: int64 capacities [batch, heads]");
  TORCH_CHECK(positions.scalar_type() == torch::kInt32 && positions.is_contiguous(), "append_coded: int32 positions");
  const int64_t units = starts.numel();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* capacity = capacities.data_ptr<int64_t>();
  const int64_t slots = positions.size(0);
  std::vector<int64_t> targets(units);
  for (int64_t unit = 0; unit < units; ++unit) {
    targets[unit] = start[unit] + length[unit];
    TORCH_CHECK(length[unit] >= 0 && length[unit] < capacity[unit] && targets[unit] < slots,
                "append_coded: a segment has no free slot");
  }
  for (size_t k = 0; k < rows.size(); ++k) {
    const torch::Tensor& part = rows[k];
    const int64_t head_dim = part.size(-1);
    const int64_t width = bits[k];
    TORCH_CHECK(part.is_contiguous() && part.scalar_type() == torch::kFloat32 && part.numel() == units * head_dim,
                "append_coded: each part's rows: contiguous float32 [batch, heads, 1, head_dim]");
    TORCH_CHECK(packs(width), "append_coded: bits 2, 3, 4, 5 or 8");
    TORCH_CHECK(head_dim % group_size == 0 && head_dim % packed_channels(width) == 0,
                "append_coded: the groups must divide the channels");
    const torch::Tensor& codes = coded[3 * k];
    const torch::Tensor& scales = coded[3 * k + 1];
    const torch::Tensor& offsets = coded[3 * k + 2];
    const int64_t code_bytes = head_dim * width / 8, groups = head_dim / group_size;
    TORCH_CHECK(codes.scalar_type() == torch::kUInt8 && codes.is_contiguous() && codes.numel() == slots * code_bytes &&
                scales.is_contiguous() && offsets.is_contiguous() && scales.numel() == slots * groups &&
                offsets.numel() == slots * groups && scales.scalar_type() == offsets.scalar_type(),
                "append_coded: a part's codes, scales and offsets must match its width and the slots");
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scales.scalar_type(), "append_coded", [&] {
      for (int64_t unit = 0; unit < units; ++unit) {
        const int64_t slot = targets[unit];
        encode_rows<scalar_t>(part.data_ptr<float>() + unit * head_dim, 1, head_dim, width, group_size,
                              codes.data_ptr<uint8_t>() + slot * code_bytes, scales.data_ptr<scalar_t>() + slot * groups,
                              offsets.data_ptr<scalar_t>() + slot * groups);
      }
    });
  }
  int32_t* held = positions.data_ptr<int32_t>();
  for (int64_t unit = 0; unit < units; ++unit) held[targets[unit]] = static_cast<int32_t>(position);
  write_rows_at(written, values, targets.data(), units, "append_coded");
  for (const auto& tensor : zeroed) {
    const auto [row_bytes, data] = rows_of(tensor);
    TORCH_CHECK(tensor.size(0) == slots, "append_coded: every field holds the same slots");
    for (int64_t unit = 0; unit < units; ++unit) std::memset(data + targets[unit] * row_bytes, 0, row_bytes);
  }
}

// A storage laid out again: for each pair of `sources` and `targets` (the old and new tensors of a field), each new
// segment's `lengths` entries (int64 [batch, heads]) copied from the old segment `segments` (int64 [batch, heads],
// a flat index into `old_starts`) to the new segment's start (`new_starts`, int64 [batch, heads]), as one block.
void copy_segments(const std::vector<torch::Tensor>& sources, const std::vector<torch::Tensor>& targets,
                   const torch::Tensor& old_starts, const torch::Tensor& segments, const torch::Tensor& new_starts,
                   const torch::Tensor& lengths) {
  TORCH_CHECK(sources.size() == targets.size(), "copy_segments: one target per source");
  for (const auto* index : {&old_starts, &segments, &new_starts, &lengths})
    TORCH_CHECK(index->scalar_type() == torch::kInt64 && index->is_contiguous(), "copy_segments: contiguous int64");
  TORCH_CHECK(segments.numel() == new_starts.numel() && lengths.numel() == new_starts.numel(),
              "copy_segments: one segment, start and length per new segment");
  const int64_t units = new_starts.numel(), old_units = old_starts.numel();
  const int64_t* old_start = old_starts.data_ptr<int64_t>();
  const int64_t* segment = segments.data_ptr<int64_t>();
  const int64_t* new_start = new_starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (size_t k = 0; k < sources.size(); ++k) {
    const auto [row_bytes, from] = rows_of(sources[k]);
    const auto [target_row_bytes, to] = rows_of(targets[k]);
    TORCH_CHECK(row_bytes == target_row_bytes && sources[k].scalar_type() == targets[k].scalar_type(),
                "copy_segments: a field's old and new rows must match");
    const int64_t old_rows = sources[k].size(0), new_rows = targets[k].size(0);
    for (int64_t unit = 0; unit < units; ++unit) {
      TORCH_CHECK(segment[unit] >= 0 && segment[unit] < old_units, "copy_segments: a segment out of range");
      const int64_t first = old_start[segment[unit]], count = length[unit];
      TORCH_CHECK(count >= 0 && first >= 0 && first + count <= old_rows && new_start[unit] >= 0 &&
                  new_start[unit] + count <= new_rows, "copy_segments: a segment out of range");
      std::memcpy(to + new_start[unit] * row_bytes, from + first * row_bytes, count * row_bytes);
    }
  }
}

// One entry evicted from each segment whose `drops` (int64 [batch, heads]) is 1: the valid entry of lowest priority
// (the first such slot; a NaN ranks lowest), where priority is the score (times the value's norm where
// `value_norms` is given), raised to `protected_rank` for the sinks (positions below the row's `pads` plus
// `sink_tokens`) and the recent tokens (from `seen` - `recent_tokens`), and under a `window` (0: none) lowered to
// -`protected_rank` for the positions at or below `seen` - `window`. The segment's last entry moves into its slot
// (every field of `fields`); the caller sets the lengths. What eviction.py's protect, lowest and removal_moves do.
void evict_one(const std::vector<torch::Tensor>& fields, const torch::Tensor& scores,
               const c10::optional<torch::Tensor>& value_norms, const torch::Tensor& positions,
               const torch::Tensor& starts, const torch::Tensor& lengths, const torch::Tensor& drops, int64_t seen,
               int64_t sink_tokens, int64_t recent_tokens, const c10::optional<torch::Tensor>& pads, int64_t window,
               double protected_rank) {
  TORCH_CHECK(scores.scalar_type() == torch::kFloat32 && positions.scalar_type() == torch::kInt32 &&
              scores.is_contiguous() && positions.is_contiguous(), "evict_one: float32 scores, int32 positions");
  for (const auto* index : {&starts, &lengths, &drops})
    TORCH_CHECK(index->scalar_type() == torch::kInt64 && index->is_contiguous() && index->numel() == starts.numel(),
                "evict_one: int64 starts, lengths and drops [batch, heads]");
  const float* norms = nullptr;
  if (value_norms.has_value()) {
    TORCH_CHECK(value_norms->scalar_type() == torch::kFloat32 && value_norms->is_contiguous(),
                "evict_one: float32 value norms");
    norms = value_norms->data_ptr<float>();
  }
  const int64_t* pad = nullptr;
  if (pads.has_value()) {
    TORCH_CHECK(pads->scalar_type() == torch::kInt64 && pads->is_contiguous() && pads->numel() == starts.size(0),
                "evict_one: int64 pads [batch]");
    pad = pads->data_ptr<int64_t>();
  }
  const int64_t heads = starts.size(1), units = starts.numel(), slots = scores.numel();
  const float* score = scores.data_ptr<float>();
  const int32_t* position = positions.data_ptr<int32_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t* drop = drops.data_ptr<int64_t>();
  const float high = static_cast<float>(protected_rank), low = -high;
  for (int64_t unit = 0; unit < units; ++unit) {
    if (drop[unit] <= 0) continue;
    TORCH_CHECK(drop[unit] == 1, "evict_one: one entry a segment at most");
    const int64_t first = start[unit], count = length[unit];
    TORCH_CHECK(count >= 1 && first >= 0 && first + count <= slots, "evict_one: a segment out of range");
    const int64_t sinks_below = (pad != nullptr ? pad[unit / heads] : 0) + sink_tokens;
    int64_t victim = 0;
    float least = std::numeric_limits<float>::infinity();
    bool found = false;
    for (int64_t s = 0; s < count; ++s) {
      const int64_t at = position[first + s];
      float rank = norms != nullptr ? score[first + s] * norms[first + s] : score[first + s];
      if (at < sinks_below || at >= seen - recent_tokens) rank = high;
      if (window > 0 && at <= seen - window) rank = low;
      if (std::isnan(rank)) {
        victim = s;
        break;
      }
      if (!found || rank < least) least = rank, victim = s, found = true;
    }
    const int64_t tail = count - 1;
    if (victim == tail) continue;
    for (const auto& tensor : fields) {
      const auto [row_bytes, data] = rows_of(tensor);
      std::memcpy(data + (first + victim) * row_bytes, data + (first + tail) * row_bytes, row_bytes);
    }
  }
}

// In `flat` (float32 [slots], a storage's field), each segment's first min(length, stop) slots (from `starts`, int64
// [batch, heads]) decayed by `decay`, then `added` (float32 [batch, heads, stop]) added: a multiplication then an
// addition, each rounded, as PyTorch's mul_ then add_ round them.
void decay_add(const torch::Tensor& flat, const torch::Tensor& starts, const torch::Tensor& lengths,
               const torch::Tensor& added, double decay) {
  TORCH_CHECK(flat.is_contiguous() && flat.scalar_type() == torch::kFloat32 && added.is_contiguous() &&
              added.scalar_type() == torch::kFloat32 && added.dim() == 3, "decay_add: float32 field and additions");
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64 &&
              starts.is_contiguous() && lengths.is_contiguous() && starts.numel() == added.size(0) * added.size(1),
              "decay_add: int64 starts and lengths, one per segment");
  const int64_t units = starts.numel(), stop = added.size(2), slots = flat.numel();
  float* values = flat.data_ptr<float>();
  const float* from = added.data_ptr<float>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const float factor = static_cast<float>(decay);
  for (int64_t unit = 0; unit < units; ++unit) {
    const int64_t count = std::min(length[unit], stop);
    TORCH_CHECK(start[unit] >= 0 && start[unit] + count <= slots, "decay_add: a segment out of range");
    float* segment = values + start[unit];
    const float* row = from + unit * stop;
    for (int64_t s = 0; s < count; ++s) {
      volatile float decayed = segment[s] * factor;  // (rounded before the addition, never fused with it)
      segment[s] = decayed + row[s];
    }
  }
}

// One decoding step of a coded layer (fused_step.py), as four of the operators above in a row: the step's key and
// value coded after each segment's entries (append_coded: `rows` are keys then values, `coded` their codes, scales
// and offsets), each segment's length counted up; the step's attention over every entry, its own token exact
// (step_attention); the probability each entry received, over the `query` heads of its KV head, divided by their
// number, decayed into `scores` (decay_add); one entry evicted from each segment whose `drops` is 1 (evict_one, over
// every tensor of `fields`) and its length counted down. A residual window (`ring_*`, as step_attention takes it)
// is read, not written. Returns the attention output, float32 [batch, 1, heads, head_dim].
torch::Tensor decode_step(const std::vector<torch::Tensor>& fields, const std::vector<torch::Tensor>& coded,
                          const std::vector<torch::Tensor>& rows, const std::vector<int64_t>& bits, int64_t group_size,
                          const torch::Tensor& positions, int64_t position, const std::vector<torch::Tensor>& written,
                          const std::vector<torch::Tensor>& values, const std::vector<torch::Tensor>& zeroed,
                          const torch::Tensor& starts, const torch::Tensor& lengths, const torch::Tensor& capacities,
                          const torch::Tensor& query, const torch::Tensor& own_keys, const torch::Tensor& own_values,
                          double scaling, const c10::optional<torch::Tensor>& key_means, const torch::Tensor& scores,
                          double decay, const c10::optional<torch::Tensor>& value_norms, const torch::Tensor& drops,
                          int64_t seen, int64_t sink_tokens, int64_t recent_tokens, double protected_rank,
                          const c10::optional<torch::Tensor>& ring_keys, const c10::optional<torch::Tensor>& ring_values,
                          const c10::optional<torch::Tensor>& ring_positions) {
  TORCH_CHECK(coded.size() == 6 && rows.size() == 2 && bits.size() == 2,
              "decode_step: keys and values, each with its codes, scales and offsets and its width");
  TORCH_CHECK(drops.scalar_type() == torch::kInt64 && drops.is_contiguous() && drops.numel() == lengths.numel(),
              "decode_step: int64 drops [batch, heads]");
  append_coded(coded, rows, bits, group_size, positions, position, written, values, zeroed, starts, lengths,
               capacities);
  int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t units = lengths.numel();
  int64_t longest = 0;
  for (int64_t unit = 0; unit < units; ++unit) longest = std::max(longest, ++length[unit]);
  auto [output, received] = step_attention(
      query, coded[0], coded[1], coded[2], bits[0], coded[3], coded[4], coded[5], bits[1], group_size, starts,
      lengths, own_keys, own_values, c10::nullopt,
      ring_positions.has_value() ? c10::optional<torch::Tensor>(positions) : c10::nullopt, longest, scaling, 0.0,
      position, 0,
      ring_keys, ring_values, ring_positions, key_means);
  const float group = static_cast<float>(query.size(1) / starts.size(1));
  float* paid = received.data_ptr<float>();
  for (int64_t at = 0; at < received.numel(); ++at) paid[at] = paid[at] / group;
  decay_add(scores, starts, lengths, received, decay);
  evict_one(fields, scores, value_norms, positions, starts, lengths, drops, seen, sink_tokens, recent_tokens,
            c10::nullopt, 0, protected_rank);
  const int64_t* drop = drops.data_ptr<int64_t>();
  for (int64_t unit = 0; unit < units; ++unit) length[unit] -= drop[unit];
  return output;
}

// Registered as torch.ops.decodekit's operators, for CPU tensors.
TORCH_LIBRARY(decodekit, library) {
  library.def(
      "step_attention(Tensor query, Tensor key_codes, Tensor key_scales, Tensor key_offsets, int key_bits, "
      "Tensor value_codes, Tensor value_scales, Tensor value_offsets, int value_bits, int group_size, Tensor starts, "
      "Tensor lengths, Tensor own_keys, Tensor own_values, Tensor? biases, Tensor? positions, int slots, "
      "float scaling, float softcap, int query_position, int window, Tensor? ring_keys, Tensor? ring_values, "
      "Tensor? ring_positions, Tensor? key_means) -> (Tensor, Tensor)");
  library.def("encode_entries(Tensor values, int bits, int group_size, ScalarType dtype) -> (Tensor, Tensor, Tensor)");
  library.def("copy_rows(Tensor(a!)[] tensors, Tensor source, Tensor target) -> ()");
  library.def("write_rows(Tensor(a!)[] tensors, Tensor index, Tensor[] values) -> ()");
  library.def("move_in_segments(Tensor(a!)[] tensors, Tensor starts, Tensor sources, Tensor targets, Tensor? lanes) -> ()");
  library.def("append_rows(Tensor(a!)[] tensors, Tensor[] values, Tensor(b!)[] zeroed, Tensor starts, Tensor lengths, int count) -> ()");
  library.def("copy_segments(Tensor[] sources, Tensor(a!)[] targets, Tensor old_starts, Tensor segments, Tensor new_starts, Tensor lengths) -> ()");
  library.def("evict_one(Tensor(a!)[] fields, Tensor scores, Tensor? value_norms, Tensor positions, Tensor starts, Tensor lengths, Tensor drops, int seen, int sink_tokens, int recent_tokens, Tensor? pads, int window, float protected_rank) -> ()");
  library.def("append_coded(Tensor(a!)[] coded, Tensor[] rows, int[] bits, int group_size, Tensor(b!) positions, int position, Tensor(c!)[] written, Tensor[] values, Tensor(d!)[] zeroed, Tensor starts, Tensor lengths, Tensor capacities) -> ()");
  library.def("decay_add(Tensor(a!) flat, Tensor starts, Tensor lengths, Tensor added, float decay) -> ()");
  library.def("decode_step(Tensor(a!)[] fields, Tensor(b!)[] coded, Tensor[] rows, int[] bits, int group_size, "
              "Tensor(c!) positions, int position, Tensor(d!)[] written, Tensor[] values, Tensor(e!)[] zeroed, "
              "Tensor starts, Tensor(f!) lengths, Tensor capacities, Tensor query, Tensor own_keys, Tensor own_values, "
              "float scaling, Tensor? key_means, Tensor(g!) scores, float decay, Tensor? value_norms, Tensor drops, "
              "int seen, int sink_tokens, int recent_tokens, float protected_rank, Tensor? ring_keys, "
              "Tensor? ring_values, Tensor? ring_positions) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, library) {
  library.impl("step_attention", &step_attention);
  library.impl("encode_entries", &encode_entries);
  library.impl("copy_rows", &copy_rows);
  library.impl("write_rows", &write_rows);
  library.impl("decay_add", &decay_add);
  library.impl("decode_step", &decode_step);
  library.impl("evict_one", &evict_one);
  library.impl("copy_segments", &copy_segments);
  library.impl("append_rows", &append_rows);
  library.impl("append_coded", &append_coded);
  library.impl("move_in_segments", &move_in_segments);
}
