// dropout.cuh: dropout's keep function (docs/contract.md, "Dropout's keep function"), a pure
// function of (seed, n, i, j) whatever the tiles: Random123's Philox4x32-10, one call for the
// 8 elements a thread holds of a 16 x 16 fragment tile. Host and device code: a CPU test builds
// it with the host compiler against cuflash.reference.dropout_keep.
#pragma once

#if defined(__CUDACC__)
#define CUFLASH_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CUFLASH_HOST_DEVICE inline
#endif

namespace cuflash {

CUFLASH_HOST_DEVICE unsigned int mul_hi(unsigned int a, unsigned int b) {
#if defined(__CUDA_ARCH__)
    return __umulhi(a, b);
#else
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
#endif
}

// Philox4x32-10 on counter (c0, c1, c2, c3) under key (k0, k1), in place
CUFLASH_HOST_DEVICE void philox4x32_10(unsigned int& c0, unsigned int& c1, unsigned int& c2,
                                              unsigned int& c3, unsigned int k0, unsigned int k1) {
    constexpr unsigned int M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round) {
            k0 += W0;
            k1 += W1;
        }
        const unsigned int hi0 = mul_hi(M0, c0), lo0 = M0 * c0, hi1 = mul_hi(M1, c2), lo1 = M1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
    }
}

// word w (0 to 3) of four, without indexing (a register array indexed at run time spills)
CUFLASH_HOST_DEVICE unsigned int pick_word(unsigned int c0, unsigned int c1, unsigned int c2, unsigned int c3,
                                                  unsigned int w) {
    return w & 2 ? (w & 1 ? c3 : c2) : (w & 1 ? c1 : c0);
}

// The keep function of one call: its seed as Philox's key, the threshold of dropout_p, and the
// factor kept probabilities take.
struct Dropout {
    unsigned int key0, key1;   // the seed's low and high 32 bits
    unsigned int threshold;    // floor(dropout_p * 65536): an element is dropped iff its 16 bits are below it
    float scale;               // 1 / (1 - dropout_p)

    // Whether batch entry n keeps row i's probability of key j (positions along axis -2)
    CUFLASH_HOST_DEVICE bool keep(unsigned long long n, long long i, long long j) const {
        unsigned int c0 = static_cast<unsigned int>((j / 16) * 4 + (j % 8) / 2);
        unsigned int c1 = static_cast<unsigned int>((i / 16) * 8 + i % 8);
        unsigned int c2 = static_cast<unsigned int>(n), c3 = static_cast<unsigned int>(n >> 32);
        philox4x32_10(c0, c1, c2, c3, key0, key1);
        const unsigned int word = pick_word(c0, c1, c2, c3, static_cast<unsigned int>(2 * ((i / 8) % 2) + (j / 8) % 2));
        return ((word >> (16 * (j & 1))) & 0xFFFFu) >= threshold;
    }

    // The 8 elements of entry n that mma fragment thread (g, t) = (lane / 4, lane % 4) holds of the
    // 16 x 16 tile at row i0 and key j0, both multiples of 16: rows i0 + g + 8h, keys
    // j0 + 8jb + 2t + b. One Philox call; bit 4h + 2jb + b of the result is set iff kept.
    CUFLASH_HOST_DEVICE unsigned int keep_tile(unsigned long long n, long long i0, long long j0, int g, int t) const {
        unsigned int c0 = static_cast<unsigned int>((j0 / 16) * 4 + t);
        unsigned int c1 = static_cast<unsigned int>((i0 / 16) * 8 + g);
        unsigned int c2 = static_cast<unsigned int>(n), c3 = static_cast<unsigned int>(n >> 32);
        philox4x32_10(c0, c1, c2, c3, key0, key1);
        const unsigned int words[4] = {c0, c1, c2, c3};
        unsigned int kept = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w)   // word w = 2h + jb
#pragma unroll
            for (int b = 0; b < 2; ++b) kept |= unsigned(((words[w] >> (16 * b)) & 0xFFFFu) >= threshold) << (2 * w + b);
        return kept;
    }

    // keep_tile with keys in rows (the dk/dv pass's transposed scores): thread (g, t) holds keys
    // j0 + g + 8h of queries i0 + 8jb + 2t + b. Two Philox calls, one per b; the same bits.
    CUFLASH_HOST_DEVICE unsigned int keep_tile_transposed(unsigned long long n, long long i0, long long j0, int g,
                                                          int t) const {
        unsigned int kept = 0;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            unsigned int c0 = static_cast<unsigned int>((j0 / 16) * 4 + g / 2);
            unsigned int c1 = static_cast<unsigned int>((i0 / 16) * 8 + 2 * t + b);
            unsigned int c2 = static_cast<unsigned int>(n), c3 = static_cast<unsigned int>(n >> 32);
            philox4x32_10(c0, c1, c2, c3, key0, key1);
            const unsigned int words[4] = {c0, c1, c2, c3};
#pragma unroll
            for (int w = 0; w < 4; ++w) {   // word w = 2jb + h
                const unsigned int half = (words[w] >> (16 * (g & 1))) & 0xFFFFu;
                kept |= unsigned(half >= threshold) << (4 * (w & 1) + 2 * (w >> 1) + b);
            }
        }
        return kept;
    }
};

}  // namespace cuflash
