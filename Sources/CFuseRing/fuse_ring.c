#define _GNU_SOURCE
#include "fuse_ring.h"
#include <errno.h>
#include <liburing.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

/* The kernel's side of the interface (include/uapi/linux/fuse.h, protocol 7.42), which
   Debian 12's headers predate. */
enum { CMD_REGISTER = 1, CMD_COMMIT_AND_FETCH = 2 };
enum { HEADER_IN_OUT = 128, HEADER_OP = 128 };
struct ring_ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding; uint64_t reserved; };
struct ring_req_header { char in_out[HEADER_IN_OUT]; char op_in[HEADER_OP]; struct ring_ent_in_out ent; };
struct ring_cmd_req { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };
struct in_header { uint32_t len, opcode; uint64_t unique, nodeid; uint32_t uid, gid, pid; uint16_t extlen, pad; };
struct out_header { uint32_t len; int32_t error; uint64_t unique; };

const unsigned int kbfs_ring_init_flag2 = 1u << (41 - 32);

enum { IN_HEADER = sizeof(struct in_header), OUT_HEADER = sizeof(struct out_header) };
/* Opcodes whose replies carry file contents, names or attribute values: their copy on the
   entry is zeroed once the kernel has taken it. */
enum { OP_READLINK = 5, OP_READ = 15, OP_GETXATTR = 22, OP_LISTXATTR = 23, OP_READDIR = 28, OP_READDIRPLUS = 44 };
/* user_data of the two kinds of completion. */
enum { TAG_ENTRY = 1, TAG_STOP = 2, TAG_WAKE = 3 };

/* One registered entry and the thread serving it, the ring's only submitter
   (IORING_SETUP_SINGLE_ISSUER). `unique` is the request it holds (0: none), read by other
   threads looking for a reply's entry; a reply made on another thread is handed over through
   `handoff` and `wakefd`. No locks: the entry holds one request, which gets one reply.
   With IORING_SETUP_DEFER_TASKRUN the kernel writes a request into the entry's buffers only
   inside this thread's own io_uring_enter calls, so the worker can zero what a reply left
   there without racing the next request. */
struct ring_worker {
    struct kbfs_ring *ring;
    struct io_uring uring;
    int uring_ready;
    pthread_t thread;
    int started;
    unsigned qid;
    int stopfd, wakefd;
    struct ring_req_header *header;
    unsigned char *area;    /* one page of room for the request's headers, then the payload */
    unsigned char *payload;
    size_t payload_size;
    struct iovec iov[2];
    _Atomic uint64_t unique;
    uint64_t commit_id;
    uint32_t opcode;
    uint32_t queued;          /* the command to send with the next wait: 0, CMD_REGISTER or CMD_COMMIT_AND_FETCH */
    size_t dirty;             /* bytes of file contents, names or values the last reply left in the payload */
    _Atomic int handoff;      /* a reply made on another thread waits to be committed */
};

/* The workers of one FUSE connection. */
struct kbfs_ring {
    int fd;
    unsigned queues, per_queue, count;
    kbfs_ring_process_fn process;
    void *context;
    struct ring_worker *workers;
    pthread_mutex_t start_lock;
    pthread_cond_t start_cond;
    unsigned reported;
    int failure; /* first failing errno of a worker's setup, 0 if none */
};

/* The worker whose request this thread is handling. */
static __thread struct ring_worker *current;

/* Queues the kernel makes: one per possible CPU. */
static unsigned possible_cpus(void) {
    FILE *f = fopen("/sys/devices/system/cpu/possible", "re");
    unsigned last = 0;
    if (f) {
        char line[256];
        if (fgets(line, sizeof line, f)) {
            char *p = line;
            while (*p) {
                char *end;
                unsigned long v = strtoul(p, &end, 10);
                if (end == p) break;
                last = (unsigned)v > last ? (unsigned)v : last;
                p = *end ? end + 1 : end;
            }
        }
        fclose(f);
    }
    return last + 1;
}

/* Fills `sqe` with a FUSE ring command for this worker's entry. */
static void prep_cmd(struct ring_worker *w, struct io_uring_sqe *sqe, uint32_t op, uint64_t commit_id) {
    memset(sqe, 0, 128);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = w->ring->fd;
    sqe->cmd_op = op;
    sqe->user_data = TAG_ENTRY;
    struct ring_cmd_req *req = (struct ring_cmd_req *)(void *)sqe->cmd;
    req->qid = (uint16_t)w->qid;
    req->commit_id = commit_id;
    if (op == CMD_REGISTER) {
        sqe->addr = (uint64_t)(uintptr_t)w->iov;
        sqe->len = 2;
    }
}

/* Queues the entry's registration (again, after EAGAIN). */
static int queue_register(struct ring_worker *w) {
    struct io_uring_sqe *sqe = io_uring_get_sqe(&w->uring);
    if (!sqe) return -EBUSY;
    prep_cmd(w, sqe, CMD_REGISTER, 0);
    return 0;
}

/* Buffers, ring and registration of one worker; 0 or -errno. */
static int setup_worker(struct ring_worker *w) {
    long page = sysconf(_SC_PAGESIZE);
    size_t header_size = (sizeof(struct ring_req_header) + (size_t)page - 1) & ~((size_t)page - 1);
    w->header = mmap(NULL, header_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    w->area = mmap(NULL, (size_t)page + w->payload_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (w->header == MAP_FAILED || w->area == MAP_FAILED) return -ENOMEM;
    w->payload = w->area + page;
    w->iov[0] = (struct iovec){ .iov_base = w->header, .iov_len = sizeof(struct ring_req_header) };
    w->iov[1] = (struct iovec){ .iov_base = w->payload, .iov_len = w->payload_size };
    w->stopfd = eventfd(0, EFD_CLOEXEC);
    w->wakefd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (w->stopfd < 0 || w->wakefd < 0) return -errno;
    struct io_uring_params params;
    memset(&params, 0, sizeof params);
    params.flags = IORING_SETUP_SQE128 | IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
    int rc = io_uring_queue_init_params(8, &w->uring, &params);
    if (rc < 0) return rc;
    w->uring_ready = 1;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&w->uring);
    io_uring_prep_poll_add(sqe, w->stopfd, POLLIN);
    sqe->user_data = TAG_STOP;
    sqe = io_uring_get_sqe(&w->uring);
    io_uring_prep_poll_add(sqe, w->wakefd, POLLIN);
    sqe->user_data = TAG_WAKE;
    for (int attempt = 0;; attempt++) {
        if ((rc = queue_register(w)) < 0) return rc;
        if ((rc = io_uring_submit(&w->uring)) < 0) return rc;
        struct io_uring_cqe *cqe;
        if (io_uring_peek_cqe(&w->uring, &cqe) != 0) return 0;  /* registered: waiting for a request */
        rc = cqe->res;
        io_uring_cqe_seen(&w->uring, cqe);
        if (rc == -EAGAIN && attempt < 100) { usleep(10000); continue; }  /* INIT not yet taken in */
        return rc < 0 ? rc : -EPROTO;
    }
}

/* Lays the request out as /dev/fuse would, right before the payload it already sits next to,
   and hands it on; a malformed one is answered EIO. */
static void handle_request(struct ring_worker *w) {
    struct in_header *in = (struct in_header *)(void *)w->header->in_out;
    uint32_t payload = w->header->ent.payload_sz;
    w->commit_id = w->header->ent.commit_id;
    size_t op = in->len >= IN_HEADER + (size_t)payload ? in->len - IN_HEADER - payload : SIZE_MAX;
    if (op > HEADER_OP || payload > w->payload_size || in->unique == 0) {
        struct out_header *out = (struct out_header *)(void *)w->header->in_out;
        uint64_t unique = in->unique;
        *out = (struct out_header){ .len = OUT_HEADER, .error = -EIO, .unique = unique };
        w->header->ent.payload_sz = 0;
        w->queued = CMD_COMMIT_AND_FETCH;
        return;
    }
    unsigned char *request = w->payload - IN_HEADER - op;
    memmove(request + IN_HEADER, w->header->op_in, op);
    memcpy(request, in, IN_HEADER);
    w->opcode = in->opcode;
    atomic_store_explicit(&w->unique, in->unique, memory_order_release);
    current = w;
    w->ring->process(w->ring->context, request, IN_HEADER + op + payload);
    current = NULL;
}

/* A worker: waits for the kernel to fill its entry, handles the request, and sends the
   reply with the next wait. */
static void *worker_main(void *arg) {
    struct ring_worker *w = arg;
    struct kbfs_ring *ring = w->ring;
    char name[16];
    snprintf(name, sizeof name, "kbfs-ring-%u", w->qid);
    pthread_setname_np(pthread_self(), name);
    /* Not pinned to the queue's CPU: measured slower here (the caller and the worker then
       share one CPU; docs/PERFORMANCE.md). */
    int rc = setup_worker(w);
    pthread_mutex_lock(&ring->start_lock);
    if (rc < 0 && ring->failure == 0) ring->failure = -rc;
    ring->reported++;
    pthread_cond_broadcast(&ring->start_cond);
    pthread_mutex_unlock(&ring->start_lock);
    if (rc < 0) return NULL;
    for (;;) {
        struct io_uring_cqe *cqe;
        int res;
        struct io_uring_sqe *sqe = w->queued ? io_uring_get_sqe(&w->uring) : NULL;
        if (sqe) {
            prep_cmd(w, sqe, w->queued, w->queued == CMD_COMMIT_AND_FETCH ? w->commit_id : 0);
            w->queued = 0;
        }
        if (sqe && w->dirty) {
            /* The commit hands the reply to the kernel, which may fill the entry with the next
               request in the same call (it then rewrites the header's commit id). Whatever of
               the reply that request did not overwrite is zeroed before waiting. */
            w->header->ent.commit_id = 0;
            res = io_uring_submit(&w->uring);
            size_t kept = w->header->ent.commit_id != 0 ? w->header->ent.payload_sz : 0;
            if (kept < w->dirty) explicit_bzero(w->payload + kept, w->dirty - kept);
            w->dirty = 0;
            if (res >= 0) res = io_uring_wait_cqe(&w->uring, &cqe);
        } else if (sqe) {
            res = io_uring_submit_and_wait(&w->uring, 1);
        } else {
            res = io_uring_wait_cqe(&w->uring, &cqe);
        }
        if (res < 0 && res != -EINTR && res != -EAGAIN && res != -ETIME) return NULL;
        while (io_uring_peek_cqe(&w->uring, &cqe) == 0) {
            uint64_t tag = cqe->user_data;
            int result = cqe->res;
            io_uring_cqe_seen(&w->uring, cqe);
            if (tag == TAG_STOP) return NULL;
            if (tag == TAG_WAKE) {
                uint64_t n;
                (void)!read(w->wakefd, &n, sizeof n);
                struct io_uring_sqe *poll = io_uring_get_sqe(&w->uring);
                if (poll) { io_uring_prep_poll_add(poll, w->wakefd, POLLIN); poll->user_data = TAG_WAKE; }
                if (atomic_exchange(&w->handoff, 0)) w->queued = CMD_COMMIT_AND_FETCH;
                continue;
            }
            if (result == -EAGAIN || result == -EINTR) {
                w->queued = CMD_REGISTER;
                continue;
            }
            if (result < 0) return NULL;  /* -ENOTCONN, -ENODEV: the connection is gone */
            handle_request(w);
        }
    }
}

struct kbfs_ring *kbfs_ring_start(int fuse_fd, unsigned per_queue, size_t payload, kbfs_ring_process_fn process,
                                  void *context, char *why, size_t why_len) {
    struct kbfs_ring *ring = calloc(1, sizeof *ring);
    if (!ring) { snprintf(why, why_len, "out of memory"); return NULL; }
    ring->fd = fuse_fd;
    ring->queues = possible_cpus();
    ring->per_queue = per_queue ? per_queue : 1;
    ring->count = ring->queues * ring->per_queue;
    ring->process = process;
    ring->context = context;
    pthread_mutex_init(&ring->start_lock, NULL);
    pthread_cond_init(&ring->start_cond, NULL);
    ring->workers = calloc(ring->count, sizeof *ring->workers);
    if (!ring->workers) { free(ring); snprintf(why, why_len, "out of memory"); return NULL; }
    unsigned made = 0;
    for (unsigned i = 0; i < ring->count; i++) {
        struct ring_worker *w = &ring->workers[i];
        w->ring = ring;
        w->qid = i % ring->queues;
        w->stopfd = w->wakefd = -1;
        w->payload_size = payload;
        if (pthread_create(&w->thread, NULL, worker_main, w) != 0) break;
        w->started = 1;
        made++;
    }
    pthread_mutex_lock(&ring->start_lock);
    while (ring->reported < made) pthread_cond_wait(&ring->start_cond, &ring->start_lock);
    int failure = made < ring->count ? EAGAIN : ring->failure;
    pthread_mutex_unlock(&ring->start_lock);
    if (failure) {
        snprintf(why, why_len, "%s", strerror(failure));
        kbfs_ring_stop(ring);
        return NULL;
    }
    return ring;
}

unsigned kbfs_ring_queues(const struct kbfs_ring *ring) { return ring->queues; }
unsigned kbfs_ring_workers(const struct kbfs_ring *ring) { return ring->count; }

/* The worker holding request `unique`, or NULL. */
static struct ring_worker *holder(struct kbfs_ring *ring, uint64_t unique) {
    if (current && current->ring == ring && atomic_load_explicit(&current->unique, memory_order_acquire) == unique)
        return current;
    for (unsigned i = 0; i < ring->count; i++)
        if (atomic_load_explicit(&ring->workers[i].unique, memory_order_acquire) == unique) return &ring->workers[i];
    return NULL;
}

ssize_t kbfs_ring_reply(struct kbfs_ring *ring, const struct iovec *iov, int count) {
    if (count < 1 || iov[0].iov_len < OUT_HEADER) return -2;
    const struct out_header *oh = iov[0].iov_base;
    if (oh->unique == 0) return -2;
    struct ring_worker *w = holder(ring, oh->unique);
    if (!w) return -2;
    size_t total = iov[0].iov_len, body = 0;
    int copied = 0, error = oh->error;
    for (int i = 1; i < count; i++) total += iov[i].iov_len;
    if (total - iov[0].iov_len > w->payload_size) {
        error = -EIO;  /* cannot happen with the negotiated sizes; the request must still end */
    } else {
        for (int i = 1; i < count; i++) {
            memcpy(w->payload + body, iov[i].iov_base, iov[i].iov_len);
            body += iov[i].iov_len;
        }
        copied = body > 0;
    }
    if (error) body = 0;
    struct out_header *out = (struct out_header *)(void *)w->header->in_out;
    *out = (struct out_header){ .len = (uint32_t)(OUT_HEADER + body), .error = error, .unique = oh->unique };
    w->header->ent.payload_sz = (uint32_t)body;
    int secret = w->opcode == OP_READ || w->opcode == OP_READDIR || w->opcode == OP_READDIRPLUS ||
                 w->opcode == OP_READLINK || w->opcode == OP_GETXATTR || w->opcode == OP_LISTXATTR;
    w->dirty = secret && copied ? body : 0;
    atomic_store_explicit(&w->unique, 0, memory_order_release);
    if (w == current) {
        w->queued = CMD_COMMIT_AND_FETCH;  /* sent with the worker's next wait */
    } else {
        atomic_store(&w->handoff, 1);
        uint64_t one = 1;
        if (write(w->wakefd, &one, sizeof one) != sizeof one) return -1;
    }
    return (ssize_t)total;
}

void kbfs_ring_stop(struct kbfs_ring *ring) {
    if (!ring) return;
    for (unsigned i = 0; i < ring->count; i++) {
        struct ring_worker *w = &ring->workers[i];
        if (!w->started) continue;
        if (w->stopfd >= 0) { uint64_t one = 1; (void)!write(w->stopfd, &one, sizeof one); }
    }
    long page = sysconf(_SC_PAGESIZE);
    size_t header_size = (sizeof(struct ring_req_header) + (size_t)page - 1) & ~((size_t)page - 1);
    for (unsigned i = 0; i < ring->count; i++) {
        struct ring_worker *w = &ring->workers[i];
        if (!w->started) continue;
        pthread_join(w->thread, NULL);
        if (w->uring_ready) io_uring_queue_exit(&w->uring);
        if (w->stopfd >= 0) close(w->stopfd);
        if (w->wakefd >= 0) close(w->wakefd);
        if (w->header && w->header != MAP_FAILED) munmap(w->header, header_size);
        if (w->area && w->area != MAP_FAILED) {
            explicit_bzero(w->payload, w->payload_size);
            munmap(w->area, (size_t)page + w->payload_size);
        }
    }
    free(ring->workers);
    pthread_mutex_destroy(&ring->start_lock);
    pthread_cond_destroy(&ring->start_cond);
    free(ring);
}
