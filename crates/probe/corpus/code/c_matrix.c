#include <stdio.h>

#define N 3

/* Gaussian elimination with partial pivoting. */
static void swap_rows(double m[N][N + 1], int a, int b) {
    for (int k = 0; k <= N; k++) {
        double tmp = m[a][k];
        m[a][k] = m[b][k];
        m[b][k] = tmp;
    }
}

static double fabs_local(double x) {
    return x < 0 ? -x : x;
}

static int solve(double m[N][N + 1], double out[N]) {
    for (int col = 0; col < N; col++) {
        int pivot = col;
        for (int row = col + 1; row < N; row++) {
            if (fabs_local(m[row][col]) > fabs_local(m[pivot][col])) {
                pivot = row;
            }
        }
        if (fabs_local(m[pivot][col]) < 1e-12) {
            return -1;
        }
        swap_rows(m, col, pivot);
        for (int row = col + 1; row < N; row++) {
            double factor = m[row][col] / m[col][col];
            for (int k = col; k <= N; k++) {
                m[row][k] -= factor * m[col][k];
            }
        }
    }
    for (int row = N - 1; row >= 0; row--) {
        double acc = m[row][N];
        for (int k = row + 1; k < N; k++) {
            acc -= m[row][k] * out[k];
        }
        out[row] = acc / m[row][row];
    }
    return 0;
}

int main(void) {
    double m[N][N + 1] = {{2, 1, -1, 8}, {-3, -1, 2, -11}, {-2, 1, 2, -3}};
    double x[N];
    if (solve(m, x) == 0) {
        printf("%.3f %.3f %.3f\n", x[0], x[1], x[2]);
    }
    return 0;
}
