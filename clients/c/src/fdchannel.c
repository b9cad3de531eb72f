/* fd channel framing and transport (docs/protocol.md). Plain C. */
#define _GNU_SOURCE
#include "fdchannel.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static void set_err(char *err, size_t err_len, const char *fmt, ...)
{
    if (!err || !err_len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_len, fmt, ap);
    va_end(ap);
}

static uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t get32(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static uint64_t get64(const uint8_t *p) { return (uint64_t)get32(p) | ((uint64_t)get32(p + 4) << 32); }
static void put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    put32(p, (uint32_t)v);
    put32(p + 4, (uint32_t)(v >> 32));
}

static size_t put_header(uint8_t *buf, uint16_t type, uint32_t payload_len)
{
    put32(buf, KVC_FD_MAGIC);
    put16(buf + 4, KVC_FD_VERSION);
    put16(buf + 6, type);
    put32(buf + 8, payload_len);
    put32(buf + 12, 0);
    return KVC_FD_HEADER_SIZE;
}

size_t kvc_fd_encode_hello(uint8_t *buf, size_t cap, uint64_t channel_id, uint32_t pid,
                           uint32_t uid, uint32_t gid, uint32_t max_fds,
                           const uint8_t secret[KVC_FD_SECRET_SIZE])
{
    size_t len = KVC_FD_HEADER_SIZE + KVC_FD_HELLO_SIZE;
    if (!buf || cap < len || !secret)
        return 0;
    uint8_t *p = buf + put_header(buf, KVC_FD_HELLO, KVC_FD_HELLO_SIZE);
    put64(p, channel_id);
    put32(p + 8, pid);
    put32(p + 12, uid);
    put32(p + 16, gid);
    put32(p + 20, max_fds);
    memcpy(p + 24, secret, KVC_FD_SECRET_SIZE);
    return len;
}

static size_t encode_pages(uint8_t *buf, size_t cap, uint16_t type, uint64_t first_field,
                           uint32_t first_index, uint32_t total, const uint64_t *page_ids,
                           uint32_t count)
{
    if (!buf || !page_ids || count == 0 || count > KVC_FD_MAX_FDS)
        return 0;
    uint32_t payload = KVC_FD_PAGES_FIXED + 8u * count;
    size_t len = KVC_FD_HEADER_SIZE + payload;
    if (cap < len)
        return 0;
    uint8_t *p = buf + put_header(buf, type, payload);
    put64(p, first_field);
    put32(p + 8, first_index);
    put32(p + 12, count);
    put32(p + 16, total);
    put32(p + 20, 0);
    for (uint32_t i = 0; i < count; i++)
        put64(p + KVC_FD_PAGES_FIXED + 8u * i, page_ids[i]);
    return len;
}

size_t kvc_fd_encode_pages(uint8_t *buf, size_t cap, uint64_t allocation_id, uint32_t first_index,
                           uint32_t total, const uint64_t *page_ids, uint32_t count)
{
    return encode_pages(buf, cap, KVC_FD_PAGES, allocation_id, first_index, total, page_ids, count);
}

size_t kvc_fd_encode_adopt(uint8_t *buf, size_t cap, uint64_t session_id, uint32_t first_index,
                           uint32_t total, const uint64_t *page_ids, uint32_t count)
{
    return encode_pages(buf, cap, KVC_FD_ADOPT, session_id, first_index, total, page_ids, count);
}

size_t kvc_fd_encode_error(uint8_t *buf, size_t cap, uint32_t code, const char *message)
{
    size_t mlen = message ? strlen(message) : 0;
    if (mlen > KVC_FD_MAX_MESSAGE)
        mlen = KVC_FD_MAX_MESSAGE;
    size_t len = KVC_FD_HEADER_SIZE + 4 + mlen;
    if (!buf || cap < len)
        return 0;
    uint8_t *p = buf + put_header(buf, KVC_FD_ERROR, (uint32_t)(4 + mlen));
    put32(p, code);
    if (mlen)
        memcpy(p + 4, message, mlen);
    return len;
}

size_t kvc_fd_encode_goodbye(uint8_t *buf, size_t cap)
{
    if (!buf || cap < KVC_FD_HEADER_SIZE)
        return 0;
    return put_header(buf, KVC_FD_GOODBYE, 0);
}

size_t kvc_fd_encode_reply(uint8_t *buf, size_t cap, uint64_t req_id, uint32_t code,
                           uint64_t value, const char *message)
{
    size_t mlen = message ? strlen(message) : 0;
    if (mlen > 4000)
        mlen = 4000; /* as the daemon cuts it */
    size_t len = KVC_FD_HEADER_SIZE + KVC_FD_REPLY_FIXED + mlen;
    if (!buf || cap < len)
        return 0;
    uint8_t *p = buf + put_header(buf, KVC_FD_REPLY, (uint32_t)(KVC_FD_REPLY_FIXED + mlen));
    put64(p, req_id);
    put32(p + 8, code);
    put32(p + 12, 0);
    put64(p + 16, value);
    if (mlen)
        memcpy(p + KVC_FD_REPLY_FIXED, message, mlen);
    return len;
}

size_t kvc_fd_encode_allocate(uint8_t *buf, size_t cap, uint64_t req_id, uint32_t num_pages,
                              uint32_t flags, uint32_t wait_timeout_ms, const char *device)
{
    size_t dlen = device ? strlen(device) : 0;
    if (dlen > 1024)
        return 0;
    size_t len = KVC_FD_HEADER_SIZE + KVC_FD_ALLOCATE_FIXED + dlen;
    if (!buf || cap < len)
        return 0;
    uint8_t *p = buf + put_header(buf, KVC_FD_ALLOCATE, (uint32_t)(KVC_FD_ALLOCATE_FIXED + dlen));
    put64(p, req_id);
    put32(p + 8, num_pages);
    put32(p + 12, flags);
    put32(p + 16, wait_timeout_ms);
    put32(p + 20, (uint32_t)dlen);
    if (dlen)
        memcpy(p + KVC_FD_ALLOCATE_FIXED, device, dlen);
    return len;
}

static size_t encode_ids(uint8_t *buf, size_t cap, uint16_t type, uint64_t req_id,
                         const uint64_t *page_ids, uint32_t count, uint32_t flags)
{
    if (!buf || (!page_ids && count) || count > KVC_FD_MAX_FREE_IDS) /* count 0: well formed (the daemon refuses it) */
        return 0;
    uint32_t payload = KVC_FD_FREE_FIXED + 8u * count;
    size_t len = KVC_FD_HEADER_SIZE + payload;
    if (cap < len)
        return 0;
    uint8_t *p = buf + put_header(buf, type, payload);
    put64(p, req_id);
    put32(p + 8, count);
    put32(p + 12, flags);
    for (uint32_t i = 0; i < count; i++)
        put64(p + KVC_FD_FREE_FIXED + 8u * i, page_ids[i]);
    return len;
}

size_t kvc_fd_encode_free(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                          uint32_t count)
{
    return encode_ids(buf, cap, KVC_FD_FREE, req_id, page_ids, count, 0);
}

size_t kvc_fd_encode_free_flags(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                                uint32_t count, uint32_t flags)
{
    return encode_ids(buf, cap, KVC_FD_FREE, req_id, page_ids, count, flags);
}

size_t kvc_fd_encode_dropped(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                             uint32_t count)
{
    return encode_ids(buf, cap, KVC_FD_DROPPED, req_id, page_ids, count, 0);
}

size_t kvc_fd_encode_use(uint8_t *buf, size_t cap, uint64_t req_id, const uint64_t *page_ids,
                         uint32_t count)
{
    return encode_ids(buf, cap, KVC_FD_USE, req_id, page_ids, count, 0);
}

size_t kvc_fd_encode_drop(uint8_t *buf, size_t cap, const uint64_t *page_ids, uint32_t count)
{
    if (!buf || !page_ids || count == 0 || count > KVC_FD_MAX_DROP_IDS)
        return 0;
    uint32_t payload = KVC_FD_DROP_FIXED + 8u * count;
    size_t len = KVC_FD_HEADER_SIZE + payload;
    if (cap < len)
        return 0;
    uint8_t *p = buf + put_header(buf, KVC_FD_DROP, payload);
    put32(p, count);
    put32(p + 4, 0);
    for (uint32_t i = 0; i < count; i++)
        put64(p + KVC_FD_DROP_FIXED + 8u * i, page_ids[i]);
    return len;
}

uint64_t kvc_fd_record_id(const kvc_fd_record *rec, uint32_t i)
{
    return get64(rec->free_ids + 8u * i);
}

size_t kvc_fd_encode_close(uint8_t *buf, size_t cap, uint64_t req_id)
{
    size_t len = KVC_FD_HEADER_SIZE + 8;
    if (!buf || cap < len)
        return 0;
    put64(buf + put_header(buf, KVC_FD_CLOSE, 8), req_id);
    return len;
}

size_t kvc_fd_encode_answer(uint8_t *buf, size_t cap, uint64_t req_id, uint64_t reclaim_id,
                            uint64_t bytes_given, uint64_t bytes_kept, const char *reason)
{
    size_t rlen = reason ? strlen(reason) : 0;
    if (!buf || rlen > KVC_FD_MAX_REASON)
        return 0;
    uint32_t payload = (uint32_t)(KVC_FD_ANSWER_FIXED + rlen);
    size_t len = KVC_FD_HEADER_SIZE + payload;
    if (cap < len)
        return 0;
    uint8_t *p = buf + put_header(buf, KVC_FD_ANSWER, payload);
    put64(p, req_id);
    put64(p + 8, reclaim_id);
    put64(p + 16, bytes_given);
    put64(p + 24, bytes_kept);
    if (rlen)
        memcpy(p + KVC_FD_ANSWER_FIXED, reason, rlen);
    return len;
}

static const char *type_name(uint16_t type)
{
    switch (type) {
    case KVC_FD_ADOPT: return "ADOPT";
    case KVC_FD_ALLOCATE: return "ALLOCATE";
    case KVC_FD_FREE: return "FREE";
    case KVC_FD_CLOSE: return "CLOSE";
    case KVC_FD_ANSWER: return "ANSWER";
    case KVC_FD_DROPPED: return "DROPPED";
    case KVC_FD_USE: return "USE";
    default: return "?";
    }
}

static int is_request(uint16_t type)
{
    return type == KVC_FD_ALLOCATE || type == KVC_FD_FREE || type == KVC_FD_CLOSE ||
           type == KVC_FD_ANSWER || type == KVC_FD_DROPPED || type == KVC_FD_USE;
}

/* Types only clients send (a client receiving one: a protocol error). */
static int from_client(uint16_t type)
{
    return type == KVC_FD_ADOPT || is_request(type);
}

/* "malformed NAME record: FAULT" (the daemon's REPLY message): a request
 * whose req_id was read but that breaks its own rules. */
__attribute__((format(printf, 4, 5))) static kvc_status malformed(char *err, size_t err_len,
                                                                  const char *name,
                                                                  const char *fmt, ...)
{
    char fault[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fault, sizeof fault, fmt, ap);
    va_end(ap);
    set_err(err, err_len, "malformed %s record: %s", name, fault);
    return KVC_ERR_INVALID_ARGUMENT;
}

static kvc_status decode_allocate(const uint8_t *p, uint32_t plen, kvc_fd_record *out, char *err,
                                  size_t err_len)
{
    if (plen < KVC_FD_ALLOCATE_FIXED)
        return malformed(err, err_len, "ALLOCATE", "%u payload bytes, fewer than its fixed %u",
                         plen, KVC_FD_ALLOCATE_FIXED);
    uint32_t dev_len = get32(p + 20);
    if ((uint64_t)plen != (uint64_t)KVC_FD_ALLOCATE_FIXED + dev_len)
        return malformed(err, err_len, "ALLOCATE", "device_len %u but %u bytes of device", dev_len,
                         plen - KVC_FD_ALLOCATE_FIXED);
    out->num_pages = get32(p + 8);
    out->flags = get32(p + 12);
    out->wait_timeout_ms = get32(p + 16);
    size_t n = dev_len > KVC_FD_MAX_MESSAGE ? KVC_FD_MAX_MESSAGE : dev_len;
    memcpy(out->device, p + KVC_FD_ALLOCATE_FIXED, n);
    out->device[n] = 0;
    return KVC_OK;
}

/* FREE, DROPPED and USE: count, flags (FREE's; the others' reserved), ids. */
static kvc_status decode_ids_request(uint16_t type, const uint8_t *p, uint32_t plen,
                                     kvc_fd_record *out, char *err, size_t err_len)
{
    const char *name = type_name(type);
    if (plen < KVC_FD_FREE_FIXED)
        return malformed(err, err_len, name, "%u payload bytes, fewer than its fixed %u", plen,
                         KVC_FD_FREE_FIXED);
    uint32_t count = get32(p + 8);
    if (count > KVC_FD_MAX_FREE_IDS)
        return malformed(err, err_len, name, "%u page ids, more than %u", count,
                         KVC_FD_MAX_FREE_IDS);
    if ((uint64_t)plen != (uint64_t)KVC_FD_FREE_FIXED + 8ull * count)
        return malformed(err, err_len, name, "count %u but %u bytes of page ids", count,
                         plen - KVC_FD_FREE_FIXED);
    out->count = count;
    out->flags = type == KVC_FD_FREE ? get32(p + 12) : 0;
    out->free_ids = p + KVC_FD_FREE_FIXED;
    return KVC_OK;
}

static kvc_status decode_answer(const uint8_t *p, uint32_t plen, kvc_fd_record *out, char *err,
                                size_t err_len)
{
    if (plen < KVC_FD_ANSWER_FIXED)
        return malformed(err, err_len, "ANSWER", "%u payload bytes, fewer than its fixed %u",
                         plen, KVC_FD_ANSWER_FIXED);
    uint32_t rlen = plen - KVC_FD_ANSWER_FIXED;
    if (rlen > KVC_FD_MAX_REASON)
        return malformed(err, err_len, "ANSWER", "a reason of %u bytes, more than %u", rlen,
                         KVC_FD_MAX_REASON);
    out->reclaim_id = get64(p + 8);
    out->bytes_given = get64(p + 16);
    out->bytes_kept = get64(p + 24);
    memcpy(out->reason, p + KVC_FD_ANSWER_FIXED, rlen);
    out->reason[rlen] = 0;
    return KVC_OK;
}

/* A request record (header sound, payload p of plen bytes): no req_id is a
 * protocol error, every later fault a malformed request (the daemon's
 * messages, kvcached_service/fdchannel.py _decode_request). */
static kvc_status decode_request(uint16_t type, const uint8_t *p, uint32_t plen, size_t num_fds,
                                 kvc_fd_record *out, uint64_t *req_id, char *err, size_t err_len)
{
    const char *name = type_name(type);
    if (plen < 8) {
        set_err(err, err_len, "%s record of %u payload bytes has no req_id", name, plen);
        return KVC_ERR_PROTOCOL;
    }
    uint64_t req = get64(p);
    out->req_id = req;
    if (req_id)
        *req_id = req;
    if (num_fds)
        return malformed(err, err_len, name, "carries descriptors (%zu); requests carry none",
                         num_fds);
    switch (type) {
    case KVC_FD_ALLOCATE:
        return decode_allocate(p, plen, out, err, err_len);
    case KVC_FD_FREE:
    case KVC_FD_DROPPED:
    case KVC_FD_USE:
        return decode_ids_request(type, p, plen, out, err, err_len);
    case KVC_FD_CLOSE:
        if (plen != 8)
            return malformed(err, err_len, name, "%u payload bytes, not 8", plen);
        return KVC_OK;
    default: /* ANSWER */
        return decode_answer(p, plen, out, err, err_len);
    }
}

kvc_status kvc_fd_decode(const uint8_t *buf, size_t len, const int *fds, size_t num_fds,
                         kvc_fd_record *out, char *err, size_t err_len)
{
    uint64_t req = 0;
    kvc_status st = kvc_fd_decode_any(buf, len, fds, num_fds, out, &req, err, err_len);
    if (st == KVC_ERR_INVALID_ARGUMENT)
        return KVC_ERR_PROTOCOL; /* err already names the fault */
    if (st == KVC_OK && from_client(out->type)) {
        out->num_fds = 0; /* the caller still owns (and closes) the fds */
        set_err(err, err_len, "a %s record, which only clients send", type_name(out->type));
        return KVC_ERR_PROTOCOL;
    }
    return st;
}

/* The header of a record of len bytes: magic, version, and a payload_len
 * that matches. */
static kvc_status decode_header(const uint8_t *buf, size_t len, uint16_t *type, uint32_t *plen,
                                char *err, size_t err_len)
{
    if (len < KVC_FD_HEADER_SIZE) {
        set_err(err, err_len, "record of %zu bytes is shorter than the header", len);
        return KVC_ERR_PROTOCOL;
    }
    uint32_t magic = get32(buf);
    uint16_t version = get16(buf + 4);
    *type = get16(buf + 6);
    *plen = get32(buf + 8);
    if (magic != KVC_FD_MAGIC) {
        set_err(err, err_len, "bad magic 0x%08x", magic);
        return KVC_ERR_PROTOCOL;
    }
    if (version != KVC_FD_VERSION) {
        set_err(err, err_len, "unsupported fd protocol version %u", (unsigned)version);
        return KVC_ERR_PROTOCOL;
    }
    if ((size_t)*plen != len - KVC_FD_HEADER_SIZE) {
        set_err(err, err_len, "payload is %zu bytes, header says %u", len - KVC_FD_HEADER_SIZE,
                *plen);
        return KVC_ERR_PROTOCOL;
    }
    return KVC_OK;
}

static kvc_status decode_hello(const uint8_t *p, uint32_t plen, size_t num_fds,
                               kvc_fd_record *out, char *err, size_t err_len)
{
    if (plen != KVC_FD_HELLO_SIZE || num_fds) {
        set_err(err, err_len, "malformed HELLO (%u bytes, %zu fds)", plen, num_fds);
        return KVC_ERR_PROTOCOL;
    }
    out->channel_id = get64(p);
    out->pid = get32(p + 8);
    out->uid = get32(p + 12);
    out->gid = get32(p + 16);
    out->max_fds = get32(p + 20);
    memcpy(out->secret, p + 24, KVC_FD_SECRET_SIZE);
    return KVC_OK;
}

/* PAGES and ADOPT: one descriptor per page id. */
static kvc_status decode_pages(uint16_t type, const uint8_t *p, uint32_t plen, const int *fds,
                               size_t num_fds, kvc_fd_record *out, char *err, size_t err_len)
{
    const char *name = type == KVC_FD_PAGES ? "PAGES" : "ADOPT";
    if (plen < KVC_FD_PAGES_FIXED) {
        set_err(err, err_len, "%s record too short (%u bytes)", name, plen);
        return KVC_ERR_PROTOCOL;
    }
    uint32_t count = get32(p + 12);
    if (count == 0 || count > KVC_FD_MAX_FDS || count != num_fds ||
        (uint64_t)plen != KVC_FD_PAGES_FIXED + 8ull * count) {
        set_err(err, err_len, "%s record says %u pages, carries %zu fds and %u bytes", name, count,
                num_fds, plen);
        return KVC_ERR_PROTOCOL;
    }
    out->allocation_id = get64(p);
    out->first_index = get32(p + 8);
    out->count = count;
    out->total = get32(p + 16);
    if ((uint64_t)out->first_index + count > out->total) {
        set_err(err, err_len, "%s record [%u, %llu) lies past its allocation's %u pages", name,
                out->first_index, (unsigned long long)out->first_index + count, out->total);
        return KVC_ERR_PROTOCOL;
    }
    for (uint32_t i = 0; i < count; i++) {
        out->page_ids[i] = get64(p + KVC_FD_PAGES_FIXED + 8u * i);
        out->fds[i] = fds[i];
    }
    out->num_fds = count;
    return KVC_OK;
}

/* ERROR (code, message) and REPLY (req_id, code, value, message); a message
 * longer than KVC_FD_MAX_MESSAGE is cut there. */
static kvc_status decode_error_reply(uint16_t type, const uint8_t *p, uint32_t plen,
                                     size_t num_fds, kvc_fd_record *out, char *err,
                                     size_t err_len)
{
    uint32_t fixed = type == KVC_FD_ERROR ? 4 : KVC_FD_REPLY_FIXED;
    if (plen < fixed || num_fds) {
        if (type == KVC_FD_ERROR)
            set_err(err, err_len, "malformed ERROR");
        else
            set_err(err, err_len, "malformed REPLY (%u bytes, %zu fds)", plen, num_fds);
        return KVC_ERR_PROTOCOL;
    }
    if (type == KVC_FD_ERROR) {
        out->error_code = get32(p);
    } else {
        out->req_id = get64(p);
        out->error_code = get32(p + 8);
        out->value = get64(p + 16);
    }
    size_t mlen = plen - fixed;
    if (mlen > KVC_FD_MAX_MESSAGE)
        mlen = KVC_FD_MAX_MESSAGE;
    memcpy(out->message, p + fixed, mlen);
    out->message[mlen] = 0;
    return KVC_OK;
}

/* DROP: 1..KVC_FD_MAX_DROP_IDS page ids (the spec's max_drop_ids), no
 * descriptors; the messages are fdchannel.py's. */
static kvc_status decode_drop(const uint8_t *p, uint32_t plen, size_t num_fds, kvc_fd_record *out,
                              char *err, size_t err_len)
{
    if (plen < KVC_FD_DROP_FIXED) {
        set_err(err, err_len, "DROP record too short (%u bytes)", plen);
        return KVC_ERR_PROTOCOL;
    }
    if (num_fds) {
        set_err(err, err_len, "DROP record carries descriptors (%zu)", num_fds);
        return KVC_ERR_PROTOCOL;
    }
    uint32_t count = get32(p);
    if (count == 0 || count > KVC_FD_MAX_DROP_IDS ||
        (uint64_t)plen != KVC_FD_DROP_FIXED + 8ull * count) {
        set_err(err, err_len, "DROP record says %u page ids and has %u bytes of them", count,
                plen - KVC_FD_DROP_FIXED);
        return KVC_ERR_PROTOCOL;
    }
    out->count = count;
    out->free_ids = p + KVC_FD_DROP_FIXED;
    return KVC_OK;
}

kvc_status kvc_fd_decode_any(const uint8_t *buf, size_t len, const int *fds, size_t num_fds,
                             kvc_fd_record *out, uint64_t *req_id, char *err, size_t err_len)
{
    if (!buf || !out) {
        set_err(err, err_len, "null record");
        return KVC_ERR_PROTOCOL;
    }
    uint16_t type;
    uint32_t plen;
    kvc_status st = decode_header(buf, len, &type, &plen, err, err_len);
    if (st != KVC_OK)
        return st;
    const uint8_t *p = buf + KVC_FD_HEADER_SIZE;
    out->type = type;
    out->num_fds = 0;
    if (is_request(type))
        return decode_request(type, p, plen, num_fds, out, req_id, err, err_len);
    switch (type) {
    case KVC_FD_HELLO:
        return decode_hello(p, plen, num_fds, out, err, err_len);
    case KVC_FD_PAGES:
    case KVC_FD_ADOPT:
        return decode_pages(type, p, plen, fds, num_fds, out, err, err_len);
    case KVC_FD_ERROR:
    case KVC_FD_REPLY:
        return decode_error_reply(type, p, plen, num_fds, out, err, err_len);
    case KVC_FD_GOODBYE:
        if (plen || num_fds) {
            set_err(err, err_len, "malformed GOODBYE");
            return KVC_ERR_PROTOCOL;
        }
        return KVC_OK;
    case KVC_FD_DROP:
        return decode_drop(p, plen, num_fds, out, err, err_len);
    default:
        set_err(err, err_len, "unknown record type %u", (unsigned)type);
        return KVC_ERR_PROTOCOL;
    }
}

kvc_status kvc_fd_connect(const char *path, int *fd_out, char *err, size_t err_len)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (!path || !*path || strlen(path) >= sizeof addr.sun_path) {
        set_err(err, err_len, "fd socket path \"%s\" is empty or too long", path ? path : "");
        return KVC_ERR_INVALID_ARGUMENT;
    }
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        set_err(err, err_len, "socket(AF_UNIX, SOCK_SEQPACKET): %s", strerror(errno));
        return KVC_ERR_SYSTEM;
    }
    int rc;
    do {
        rc = connect(fd, (struct sockaddr *)&addr, sizeof addr);
    } while (rc < 0 && errno == EINTR);
    if (rc < 0) {
        int e = errno;
        close(fd);
        set_err(err, err_len, "connecting the fd channel %s: %s", path, strerror(e));
        return (e == ENOENT || e == ECONNREFUSED) ? KVC_ERR_UNAVAILABLE : KVC_ERR_SYSTEM;
    }
    *fd_out = fd;
    return KVC_OK;
}

static void close_all(const int *fds, size_t n)
{
    for (size_t i = 0; i < n; i++)
        close(fds[i]);
}

/* Wait until fd is readable, at most timeout_ms (-1: no limit). */
static kvc_status wait_readable(int fd, int timeout_ms, char *err, size_t err_len)
{
    struct pollfd pfd = {.fd = fd, .events = POLLIN, .revents = 0};
    for (;;) {
        int rc = poll(&pfd, 1, timeout_ms);
        if (rc > 0)
            return KVC_OK;
        if (rc == 0) {
            set_err(err, err_len, "no record on the fd channel within %d ms", timeout_ms);
            return KVC_ERR_DEADLINE_EXCEEDED;
        }
        if (errno != EINTR) {
            set_err(err, err_len, "poll on the fd channel: %s", strerror(errno));
            return KVC_ERR_SYSTEM;
        }
    }
}

/* The descriptors that came with a message, at most KVC_FD_MAX_FDS in fds
 * (*nfds); any beyond are closed, and *too_many says so. */
static void take_fds(struct msghdr *msg, int *fds, size_t *nfds, int *too_many)
{
    *nfds = 0;
    *too_many = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *data = CMSG_DATA(c);
        for (size_t i = 0; i < k; i++) {
            int v;
            memcpy(&v, data + i * sizeof(int), sizeof v);
            if (*nfds < KVC_FD_MAX_FDS)
                fds[(*nfds)++] = v;
            else {
                close(v);
                *too_many = 1;
            }
        }
    }
}

kvc_status kvc_fd_recv(int fd, int timeout_ms, kvc_fd_record *out, int *eof, char *err,
                       size_t err_len)
{
    *eof = 0;
    kvc_status st = wait_readable(fd, timeout_ms, err, err_len);
    if (st != KVC_OK)
        return st;
    /* One byte more than the largest record, to detect an oversized one
     * (in the record: a DROP's ids stay there). */
    union {
        char space[CMSG_SPACE(sizeof(int) * KVC_FD_MAX_FDS)];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = out->raw, .iov_len = sizeof out->raw};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    memset(&ctl, 0, sizeof ctl);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = ctl.space;
    msg.msg_controllen = sizeof ctl.space;
    ssize_t n;
    do {
        n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC);
    } while (n < 0 && errno == EINTR);
    if (n < 0 && errno == ECONNRESET) {
        *eof = 1;
        return KVC_OK;
    }
    if (n < 0) {
        set_err(err, err_len, "recvmsg on the fd channel: %s", strerror(errno));
        return KVC_ERR_SYSTEM;
    }
    int fds[KVC_FD_MAX_FDS];
    size_t nfds;
    int too_many;
    take_fds(&msg, fds, &nfds, &too_many);
    if (n == 0 && nfds == 0) {
        *eof = 1;
        return KVC_OK;
    }
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || too_many) {
        set_err(err, err_len, "record or its descriptors were truncated");
        st = KVC_ERR_PROTOCOL;
    } else {
        st = kvc_fd_decode(out->raw, (size_t)n, fds, nfds, out, err, err_len);
    }
    if (st != KVC_OK)
        close_all(fds, nfds);
    return st;
}

kvc_status kvc_fd_send(int fd, const uint8_t *buf, size_t len, const int *fds, size_t num_fds,
                       char *err, size_t err_len)
{
    if (num_fds > KVC_FD_MAX_FDS) {
        set_err(err, err_len, "at most %u fds per record", KVC_FD_MAX_FDS);
        return KVC_ERR_INVALID_ARGUMENT;
    }
    union {
        char space[CMSG_SPACE(sizeof(int) * KVC_FD_MAX_FDS)];
        struct cmsghdr align;
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    if (num_fds) {
        msg.msg_control = ctl.space;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * num_fds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * num_fds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * num_fds);
    }
    ssize_t n;
    do {
        n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    if (n < 0 || (size_t)n != len) {
        set_err(err, err_len, "sendmsg on the fd channel: %s", n < 0 ? strerror(errno) : "short");
        return KVC_ERR_SYSTEM;
    }
    return KVC_OK;
}

void kvc_fd_record_close_fds(kvc_fd_record *rec)
{
    if (!rec)
        return;
    close_all(rec->fds, rec->num_fds);
    rec->num_fds = 0;
}
