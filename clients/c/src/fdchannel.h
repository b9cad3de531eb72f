/* fd channel framing (docs/protocol.md), plain C. Internal to libkvcached.
 *
 * Every record is one SOCK_SEQPACKET message: a 16-byte little-endian
 * header (magic "KVCF", version 1, type, payload_len, reserved) and the
 * payload. Page fds arrive as SCM_RIGHTS with MSG_CMSG_CLOEXEC. */
#ifndef KVC_FDCHANNEL_H
#define KVC_FDCHANNEL_H

#include <stddef.h>
#include <stdint.h>

#include "kvcached.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_FD_MAGIC 0x4643564Bu
#define KVC_FD_VERSION 1u
#define KVC_FD_HEADER_SIZE 16u
#define KVC_FD_MAX_FDS 253u
#define KVC_FD_SECRET_SIZE 32u
#define KVC_FD_HELLO_SIZE 56u
#define KVC_FD_PAGES_FIXED 24u
/* Largest record the daemon sends: a full PAGES record (2064 bytes) or a
 * REPLY/ERROR with its message (fdchannel.py MAX_RECORD). */
#define KVC_FD_MAX_RECORD (KVC_FD_HEADER_SIZE + 4096u + 64u)
/* DROP (daemon to client): count, reserved, then the ids. */
#define KVC_FD_DROP_FIXED 8u
#define KVC_FD_MAX_MESSAGE 4096u
#define KVC_FD_REPLY_FIXED 24u
#define KVC_FD_ALLOCATE_FIXED 24u
#define KVC_FD_FREE_FIXED 16u
#define KVC_FD_ANSWER_FIXED 32u
/* Bytes of an ANSWER's reason (the spec's max_reason). */
#define KVC_FD_MAX_REASON 1024u
/* Page ids in one FREE record, and the largest record a client sends. */
#define KVC_FD_MAX_FREE_IDS 16384u
#define KVC_FD_MAX_CLIENT_RECORD (KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8u * KVC_FD_MAX_FREE_IDS)
/* Page ids in one DROP record (the spec's max_drop_ids, 519): a DROP fits
 * KVC_FD_MAX_RECORD, the largest record the daemon sends; the daemon splits a
 * larger ask into several DROPs (fdchannel.py MAX_DROP_IDS). */
#define KVC_FD_MAX_DROP_IDS ((KVC_FD_MAX_RECORD - KVC_FD_HEADER_SIZE - KVC_FD_DROP_FIXED) / 8u)
/* What a client receives at most: the spec's max_daemon_record (a DROP of
 * KVC_FD_MAX_DROP_IDS ids is exactly that long). A longer record is cut on
 * receipt: a protocol error. */
#define KVC_FD_MAX_RECV KVC_FD_MAX_RECORD
/* Allocations asked for on the channel arrive as PAGES with
 * allocation_id = req_id | KVC_FD_CHANNEL_ALLOC_BIT. */
#define KVC_FD_CHANNEL_ALLOC_BIT (1ull << 63)
#define KVC_FD_ALLOC_WAIT 1u
#define KVC_FD_ALLOC_NOTIFY 2u
/* FREE flags: the sender keeps the imported handle of every page it names
 * (docs/protocol.md "Kept handles"); other bits written 0, ignored. */
#define KVC_FD_FREE_KEEP 1u
/* FREE flags: the pages stay the sender's, mapped, as standby
 * (docs/protocol.md "Standby pages": kvc_region_unmap_ranges_standby). */
#define KVC_FD_FREE_STANDBY 2u

enum {
    KVC_FD_HELLO = 1,
    KVC_FD_PAGES = 2,
    KVC_FD_ERROR = 3,
    KVC_FD_GOODBYE = 4,
    KVC_FD_ADOPT = 5, /* client to daemon: pages re-sent before ResumeSession */
    /* Requests on a session's own channel (client to daemon) and their answer. */
    KVC_FD_ALLOCATE = 6,
    KVC_FD_FREE = 7,
    KVC_FD_CLOSE = 8,
    KVC_FD_REPLY = 9,
    KVC_FD_ANSWER = 10, /* client to daemon: the answer to a reclaim request */
    /* Kept handles (docs/protocol.md "Kept handles"). */
    KVC_FD_DROP = 11,   /* daemon to client: release your kept handles of these pages */
    KVC_FD_DROPPED = 12, /* client to daemon: it keeps no handle of these pages (a request) */
    KVC_FD_USE = 13      /* client to daemon: standby pages in use again (a request) */
};

typedef struct kvc_fd_record {
    uint16_t type;
    /* HELLO */
    uint64_t channel_id;
    uint32_t pid, uid, gid, max_fds;
    uint8_t secret[KVC_FD_SECRET_SIZE];
    /* PAGES */
    uint64_t allocation_id;
    uint32_t first_index, count, total;
    uint64_t page_ids[KVC_FD_MAX_FDS];
    int fds[KVC_FD_MAX_FDS]; /* owned by the record's receiver */
    uint32_t num_fds;
    /* ERROR (error_code, message) and REPLY (req_id, error_code = its
     * gRPC status code, value, message) */
    uint32_t error_code;
    uint64_t req_id;
    uint64_t value;
    char message[KVC_FD_MAX_MESSAGE + 1];
    /* Requests (client to daemon; kvc_fd_decode_any only). ADOPT uses the
     * PAGES fields (allocation_id = the session id). ALLOCATE: num_pages,
     * flags (raw), wait_timeout_ms, device. FREE: count, flags (raw; bit
     * KVC_FD_FREE_KEEP) and the ids' bytes (free_ids: 8 * count
     * little-endian bytes inside the decoded buffer, valid while it is;
     * for kvc_fd_recv that buffer is `raw` below). DROPPED: count and
     * free_ids as FREE; USE the same. ANSWER: reclaim_id, bytes_given, bytes_kept,
     * reason (as sent, NUL-terminated).
     * DROP (daemon to client): count (1..KVC_FD_MAX_DROP_IDS) and free_ids. */
    uint32_t num_pages, flags, wait_timeout_ms;
    char device[KVC_FD_MAX_MESSAGE + 1];
    const uint8_t *free_ids;
    uint64_t reclaim_id, bytes_given, bytes_kept;
    char reason[KVC_FD_MAX_REASON + 1];
    /* kvc_fd_recv's receive buffer (one byte more than the largest record,
     * to detect an oversized one): a received DROP's free_ids point here. */
    uint8_t raw[KVC_FD_MAX_RECV + 1];
} kvc_fd_record;

/* Parse one record from `buf` as a client receives it (docs/protocol.md
 * "Framing"). `fds` are the descriptors that came with it (copied into the
 * record on success; on failure the caller still owns and must close
 * them). Returns KVC_OK or KVC_ERR_PROTOCOL with `err` saying why: every
 * malformed record is a protocol error for a client, and so is any record
 * of a type only clients send (ADOPT, ALLOCATE, FREE, CLOSE, ANSWER,
 * DROPPED, USE), well formed or not (clients never receive requests). */
kvc_status kvc_fd_decode(const uint8_t *buf, size_t len, const int *fds, size_t num_fds,
                         kvc_fd_record *out, char *err, size_t err_len);

/* Parse any record, of either direction, and classify a malformed one as
 * the spec does (fdchannel.spec.json on_malformed_request /
 * on_protocol_error): KVC_OK; KVC_ERR_INVALID_ARGUMENT for a malformed
 * request whose req_id can be read (*req_id set; `err` is the daemon's
 * REPLY message, "malformed FREE record: ..."); KVC_ERR_PROTOCOL for the
 * rest. For the codec tests (the shared vectors) and fake daemons. */
kvc_status kvc_fd_decode_any(const uint8_t *buf, size_t len, const int *fds, size_t num_fds,
                             kvc_fd_record *out, uint64_t *req_id, char *err, size_t err_len);

/* Encoders (the daemon's side; used by tests and the fake peers in them).
 * Return the record length written to `buf` (capacity `cap`), 0 if it does
 * not fit or the arguments are invalid. */
size_t kvc_fd_encode_hello(uint8_t *buf, size_t cap, uint64_t channel_id, uint32_t pid,
                           uint32_t uid, uint32_t gid, uint32_t max_fds,
                           const uint8_t secret[KVC_FD_SECRET_SIZE]);
size_t kvc_fd_encode_pages(uint8_t *buf, size_t cap, uint64_t allocation_id, uint32_t first_index,
                           uint32_t total, const uint64_t *page_ids, uint32_t count);
/* ADOPT (client to daemon): the PAGES layout with the resumed session's id
 * in the first field. */
size_t kvc_fd_encode_adopt(uint8_t *buf, size_t cap, uint64_t session_id, uint32_t first_index,
                           uint32_t total, const uint64_t *page_ids, uint32_t count);
size_t kvc_fd_encode_error(uint8_t *buf, size_t cap, uint32_t code, const char *message);
size_t kvc_fd_encode_goodbye(uint8_t *buf, size_t cap);
/* REPLY (daemon to client; tests). */
size_t kvc_fd_encode_reply(uint8_t *buf, size_t cap, uint64_t req_id, uint32_t code,
                           uint64_t value, const char *message);

/* Requests (client to daemon) on the session's channel. `flags` is
 * KVC_FD_ALLOC_WAIT | KVC_FD_ALLOC_NOTIFY; `device` may be NULL or "".
 * FREE carries 1..KVC_FD_MAX_FREE_IDS ids (buffer of
 * KVC_FD_HEADER_SIZE + KVC_FD_FREE_FIXED + 8 * count bytes). */
size_t kvc_fd_encode_allocate(uint8_t *buf, size_t cap, uint64_t req_id, uint32_t num_pages,
                              uint32_t flags, uint32_t wait_timeout_ms, const char *device);
size_t kvc_fd_encode_free(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                          uint32_t count);
/* FREE with its flags (KVC_FD_FREE_KEEP: only to a daemon whose
 * GetInfo().fd_channel_keep_handles is true). */
size_t kvc_fd_encode_free_flags(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                                uint32_t count, uint32_t flags);
/* DROPPED: FREE's layout (reserved written 0), 0..KVC_FD_MAX_FREE_IDS ids. */
size_t kvc_fd_encode_dropped(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                             uint32_t count);
/* USE: FREE's layout (reserved written 0), 0..KVC_FD_MAX_FREE_IDS ids. */
size_t kvc_fd_encode_use(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                         uint32_t count);
/* DROP (daemon to client; tests and fake daemons): 1..KVC_FD_MAX_DROP_IDS ids. */
size_t kvc_fd_encode_drop(uint8_t *buf, size_t cap, const uint64_t *page_ids, uint32_t count);
/* The i-th page id of a decoded FREE, DROPPED, USE or DROP (free_ids). */
uint64_t kvc_fd_record_id(const kvc_fd_record *rec, uint32_t i);
size_t kvc_fd_encode_close(uint8_t *buf, size_t cap, uint64_t req_id);
/* ANSWER: the session's answer to the RECLAIM event `reclaim_id` (the
 * bytes it gave back for it, the bytes it keeps, why). `reason` may be NULL;
 * longer than KVC_FD_MAX_REASON bytes is invalid (0 returned). Buffer of
 * KVC_FD_HEADER_SIZE + KVC_FD_ANSWER_FIXED + KVC_FD_MAX_REASON bytes fits any. */
size_t kvc_fd_encode_answer(uint8_t *buf, size_t cap, uint64_t req_id, uint64_t reclaim_id,
                            uint64_t bytes_given, uint64_t bytes_kept, const char *reason);

/* Connect a SOCK_SEQPACKET|SOCK_CLOEXEC socket to `path`. */
kvc_status kvc_fd_connect(const char *path, int *fd_out, char *err, size_t err_len);

/* Receive and parse one record, waiting up to timeout_ms (-1 = forever).
 * Returns KVC_OK with *eof = 0 and the record, KVC_OK with *eof = 1 at end
 * of stream, KVC_ERR_DEADLINE_EXCEEDED on timeout, KVC_ERR_PROTOCOL for a
 * malformed or truncated record (its fds closed), KVC_ERR_SYSTEM for a
 * failed system call. */
kvc_status kvc_fd_recv(int fd, int timeout_ms, kvc_fd_record *out, int *eof, char *err,
                       size_t err_len);

/* Send one record with `num_fds` descriptors (tests' fake daemon). */
kvc_status kvc_fd_send(int fd, const uint8_t *buf, size_t len, const int *fds, size_t num_fds,
                       char *err, size_t err_len);

/* Close every fd of a received record. */
void kvc_fd_record_close_fds(kvc_fd_record *rec);

#ifdef __cplusplus
}
#endif

#endif
