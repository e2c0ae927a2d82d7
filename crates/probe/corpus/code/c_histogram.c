#include <stdio.h>
#include <string.h>

#define BUCKETS 10

/* Counts word lengths of a sentence and prints a text histogram. */
static void count_lengths(const char *text, int *buckets) {
    int length = 0;
    for (const char *p = text;; p++) {
        if (*p == ' ' || *p == '\0') {
            if (length > 0) {
                int slot = length < BUCKETS ? length : BUCKETS - 1;
                buckets[slot] += 1;
            }
            length = 0;
            if (*p == '\0') {
                break;
            }
        } else {
            length++;
        }
    }
}

static int widest(const int *buckets) {
    int best = 0;
    for (int i = 0; i < BUCKETS; i++) {
        if (buckets[i] > best) {
            best = buckets[i];
        }
    }
    return best;
}

static void draw(const int *buckets, int width) {
    int peak = widest(buckets);
    for (int i = 1; i < BUCKETS; i++) {
        int bar = peak > 0 ? buckets[i] * width / peak : 0;
        printf("%2d | ", i);
        for (int j = 0; j < bar; j++) {
            putchar('#');
        }
        printf(" %d\n", buckets[i]);
    }
}

int main(void) {
    int buckets[BUCKETS];
    memset(buckets, 0, sizeof buckets);
    count_lengths("the quick brown fox jumps over the lazy dog again", buckets);
    draw(buckets, 20);
    return 0;
}
