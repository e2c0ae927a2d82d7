#include <stdio.h>
#include <stdlib.h>

/* A fixed-capacity ring buffer of integers that overwrites the oldest. */
typedef struct {
    int *data;
    size_t capacity;
    size_t head;
    size_t count;
} ring_t;

static int ring_init(ring_t *ring, size_t capacity) {
    ring->data = malloc(capacity * sizeof(int));
    if (ring->data == NULL) {
        return -1;
    }
    ring->capacity = capacity;
    ring->head = 0;
    ring->count = 0;
    return 0;
}

static void ring_push(ring_t *ring, int value) {
    size_t tail = (ring->head + ring->count) % ring->capacity;
    ring->data[tail] = value;
    if (ring->count < ring->capacity) {
        ring->count++;
    } else {
        ring->head = (ring->head + 1) % ring->capacity;
    }
}

static int ring_sum(const ring_t *ring) {
    int total = 0;
    for (size_t i = 0; i < ring->count; i++) {
        total += ring->data[(ring->head + i) % ring->capacity];
    }
    return total;
}

int main(void) {
    ring_t ring;
    if (ring_init(&ring, 4) != 0) {
        return 1;
    }
    for (int value = 1; value <= 6; value++) {
        ring_push(&ring, value * 3);
    }
    printf("sum of last %zu: %d\n", ring.count, ring_sum(&ring));
    free(ring.data);
    return 0;
}
