#include <stdint.h>
#include <stdio.h>

/* A 256-bit set with union, intersection and population count. */
typedef struct {
    uint64_t words[4];
} bitset;

static void bitset_clear(bitset *set) {
    for (int i = 0; i < 4; i++) {
        set->words[i] = 0;
    }
}

static void bitset_add(bitset *set, unsigned bit) {
    set->words[bit / 64] |= (uint64_t)1 << (bit % 64);
}

static int bitset_has(const bitset *set, unsigned bit) {
    return (set->words[bit / 64] >> (bit % 64)) & 1;
}

static int popcount(uint64_t word) {
    int bits = 0;
    while (word != 0) {
        word &= word - 1;
        bits++;
    }
    return bits;
}

static int bitset_size(const bitset *set) {
    int total = 0;
    for (int i = 0; i < 4; i++) {
        total += popcount(set->words[i]);
    }
    return total;
}

static void bitset_intersect(bitset *out, const bitset *a, const bitset *b) {
    for (int i = 0; i < 4; i++) {
        out->words[i] = a->words[i] & b->words[i];
    }
}

int main(void) {
    bitset evens, threes, both;
    bitset_clear(&evens);
    bitset_clear(&threes);
    for (unsigned n = 0; n < 256; n += 2) {
        bitset_add(&evens, n);
    }
    for (unsigned n = 0; n < 256; n += 3) {
        bitset_add(&threes, n);
    }
    bitset_intersect(&both, &evens, &threes);
    if (bitset_has(&both, 96)) {
        printf("%d multiples of six\n", bitset_size(&both));
    }
    return 0;
}
