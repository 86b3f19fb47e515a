#ifndef KEYBAGFS_FUSE_RING_H
#define KEYBAGFS_FUSE_RING_H
/* FUSE requests over io_uring (kernel 6.14+, the fuse module's enable_uring parameter),
   which libfuse 3.14 cannot use. The kernel hands each request to a ring entry this module
   registered; a worker thread lays it out as /dev/fuse would (header, per-opcode struct,
   payload, one contiguous buffer), gives it to `process`, and the reply libfuse then sends
   through FuseChannel's writev hook goes back on the entry (kbfs_ring_reply). FORGET and
   INTERRUPT stay on /dev/fuse. See docs/ARCHITECTURE.md, "FUSE over io_uring". */

#include <stddef.h>
#include <sys/types.h>
#include <sys/uio.h>

/* The bit of FUSE_INIT's second flag word that offers and accepts io_uring (FUSE_OVER_IO_URING). */
extern const unsigned int kbfs_ring_init_flag2;

/* Handles one request: `request` holds `length` bytes laid out as read from /dev/fuse. */
typedef void (*kbfs_ring_process_fn)(void *context, void *request, size_t length);

struct kbfs_ring;

/* Registers `per_queue` entries (one worker thread each, pinned to the queue's CPU) on each of
   the kernel's queues (one per possible CPU) of the FUSE connection `fuse_fd`, whose INIT
   reply (with kbfs_ring_init_flag2) has been written; `payload` is the largest request or
   reply body (max_write, max_pages pages). Returns the ring, or NULL with a reason in
   `why` (the connection then keeps using /dev/fuse alone). */
struct kbfs_ring *kbfs_ring_start(int fuse_fd, unsigned per_queue, size_t payload, kbfs_ring_process_fn process,
                                  void *context, char *why, size_t why_len);

/* Queues and worker threads of a started ring. */
unsigned kbfs_ring_queues(const struct kbfs_ring *ring);
unsigned kbfs_ring_workers(const struct kbfs_ring *ring);

/* Sends `iov` (fuse_out_header first) on the ring entry that holds its request. Returns the
   bytes sent, -1 with errno, or -2 when no entry holds that request (a reply for /dev/fuse). */
ssize_t kbfs_ring_reply(struct kbfs_ring *ring, const struct iovec *iov, int count);

/* Stops the workers (after unmount, or before it on a signal) and frees the ring. */
void kbfs_ring_stop(struct kbfs_ring *ring);
#endif
