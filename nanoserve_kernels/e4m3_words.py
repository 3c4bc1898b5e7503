"""e4m3 weights read four to an int32 word and widened to float32 in registers, for kernels that stream
them (the matrix-vector kernel, triton_gemv.py). Triton's own e4m3 conversion of a loaded tile unpacks
every byte and packs pairs again for Hopper's paired convert (byte permutes and integer multiply-adds,
more instructions than the arithmetic they feed: docs/fp8.md counts them); a word already holds the
pairs. Two ways, measured against each other by bench/gemv.py:

  - "ptx": Hopper's paired convert (cvt.rn.f16x2.e4m3x2) on each half of the word, then each float16
    widened: exact, as every e4m3 value is a float16. Inline PTX, which Triton's interpreter cannot run.
  - "bits": integer moves only. An e4m3 byte's sign to bit 31 and its exponent and mantissa to bits 20-26
    make the float32 of its value times 2^-120 (the exponent biases differ by 120; subnormals map to
    subnormals), exact as well. The caller takes x times BITS_X_UNIT (2^64) first, so that no product
    falls to a float32 subnormal, and its sums times BITS_SUM_UNIT (the other 2^56).
"""
import triton
import triton.language as tl

_E4M3X4_TO_F32 = tl.constexpr("""{
.reg .b16 lo, hi, h0, h1, h2, h3;
.reg .b32 pair01, pair23;
mov.b32 {lo, hi}, $4;
cvt.rn.f16x2.e4m3x2 pair01, lo;
cvt.rn.f16x2.e4m3x2 pair23, hi;
mov.b32 {h0, h1}, pair01;
mov.b32 {h2, h3}, pair23;
cvt.f32.f16 $0, h0;
cvt.f32.f16 $1, h1;
cvt.f32.f16 $2, h2;
cvt.f32.f16 $3, h3;
}""")
BITS_X_UNIT, BITS_SUM_UNIT = tl.constexpr(2.0 ** 64), tl.constexpr(2.0 ** 56)
_SIGN_AND_7_BITS = tl.constexpr(-0x78100000)  # 0x87F00000 as an int32


@triton.jit
def _bits_to_float32(words, byte: tl.constexpr):
    """Byte `byte` of each word as float32 times 2^-120: the byte moved to the top, then an arithmetic
    shift right by 4 (the sign lands on bit 31 and bit 27), the bits between cleared."""
    return (((words << (24 - 8 * byte)) >> 4) & _SIGN_AND_7_BITS).to(tl.float32, bitcast=True)


@triton.jit
def words_to_float32(words, CONVERT: tl.constexpr):
    """words [rows, n] int32, byte j of word i the e4m3 of column 4i + j (little-endian, as loaded), as
    float32 [rows, n, 4] in column order ("bits": times 2^-120)."""
    if CONVERT == "ptx":
        w0, w1, w2, w3 = tl.inline_asm_elementwise(_E4M3X4_TO_F32, "=r,=r,=r,=r,r", [words],
                                                   dtype=(tl.float32,) * 4, is_pure=True, pack=1)
    else:
        w0, w1, w2, w3 = (_bits_to_float32(words, 0), _bits_to_float32(words, 1), _bits_to_float32(words, 2),
                          _bits_to_float32(words, 3))
    # the outer join's axis is the last, so [..., i, j] holds w_(2i + j)
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [words.shape[0], words.shape[1], 4])
