/* For bench/prefill_products.py: y[M,N] = x[M,K] w[N,K]^T (row-major fp32), split between the OpenMP threads, each
 * thread one serial sgemm call on its block of columns (split_cols) or rows. Is MKL's two-thread rate on a prefill's
 * shapes held back by how MKL shares a product between the cores, or by the cores? `gemm` is the Fortran sgemm_ of
 * the MKL torch carries; inside a parallel region MKL runs serially (OpenMP nests no further). */
#include <stdint.h>
#include <omp.h>

typedef void (*sgemm_fn)(const char *, const char *, const int *, const int *, const int *, const float *,
                         const float *, const int *, const float *, const int *, const float *, float *, const int *);

void per_core_linear(sgemm_fn gemm, const float *x, const float *w, float *y, int M, int K, int N, int nthreads,
                     int split_cols) {
    #pragma omp parallel num_threads(nthreads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const float one = 1.f, zero = 0.f;
        const int total = split_cols ? N : M;
        const int per = ((total + nt - 1) / nt + 15) / 16 * 16; /* whole 16-wide blocks for every core but the last */
        const int lo = t * per, hi = lo + per < total ? lo + per : total;
        int n = hi - lo;
        if (n > 0 && split_cols) /* column-major view: y^T[N,M] = w[N,K] x^T[K,M]; this thread's rows of y^T */
            gemm("T", "N", &n, &M, &K, &one, w + (int64_t)lo * K, &K, x, &K, &zero, y + lo, &N);
        else if (n > 0)
            gemm("T", "N", &N, &n, &K, &one, w, &K, x + (int64_t)lo * K, &K, &zero, y + (int64_t)lo * N, &N);
    }
}
